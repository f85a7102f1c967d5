"""What the viewer's tests share: a viewer served from a thread of the test process, and a hostile multi-agent
recording (written by the recorder's own writer) whose every string tries to run as markup."""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

# Strings a page must show as text. Each sets window.__pwned if a page ever parses it as markup.
HOSTILE = {
    "experiment": "exp<img src=x onerror=window.__pwned=1>",
    "agent": "<img src=x onerror=window.__pwned=2>",
    "eps_id": "<svg onload=window.__pwned=3>",
    "env": "<img src=x onerror=window.__pwned=4>",
    "algorithm": "<script>window.__pwned=5</script>",
    "info": "<script>window.__pwned=6</script><img src=x onerror=window.__pwned=7>",
    "module": "<b onmouseover=window.__pwned=8>m</b>",
}


@contextmanager
def served(*paths: str, poll_s: float = 0.2) -> Iterator[Any]:
    """A viewer over ``paths`` (``commands.view.serve``, as the command makes it) serving from a thread."""
    from rllib_recorder.commands.view import serve

    server = serve([str(p) for p in paths], "127.0.0.1", 0, poll_s=poll_s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        server.catalog.close()
        thread.join(timeout=10)


def get(server: Any, path: str, **query: Any) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` with ``query``: (status, headers, body)."""
    url = server.url.rstrip("/") + path + ("?" + urllib.parse.urlencode(query) if query else "")
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(server: Any, path: str, **query: Any) -> Any:
    status, _, body = get(server, path, **query)
    assert status == 200, (status, body[:300])
    return json.loads(body)


def typed(spec: dict[str, str]) -> np.ndarray:
    """A typed array of the API (``view.steps.typed``) back as numpy."""
    import base64

    return np.frombuffer(base64.b64decode(spec["b64"]), {"f4": "<f4", "f8": "<f8", "i4": "<i4", "u1": "<u1"}[spec["type"]])


def hostile_run(root: str) -> str:
    """A finished two-agent, turn-based run below ``root/<hostile experiment>/``: agent ids, episode id, module
    id, infos, env and algorithm names all hostile; the agents act on alternate env steps."""
    from ray.rllib.env.multi_agent_episode import MultiAgentEpisode

    from rllib_recorder.format.datasets import StorageOptions
    from rllib_recorder.format.manifest import write_manifest
    from rllib_recorder.record.convert import episodes_to_chunk
    from rllib_recorder.service.writer import RecordingWriter

    a, b = HOSTILE["agent"], "b"
    run_dir = os.path.join(root, HOSTILE["experiment"], "PPO_hostile_00000")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    obs = lambda v: np.array([v, -v], np.float32)  # noqa: E731
    steps = 6
    observations = [{(a if t % 2 == 0 else b): obs(t)} for t in range(steps)] + [{a: obs(steps), b: obs(-1)}]
    acting = [a if t % 2 == 0 else b for t in range(steps)]
    episode = MultiAgentEpisode(
        id_=HOSTILE["eps_id"], observations=observations, actions=[{who: t % 2} for t, who in enumerate(acting)],
        rewards=[{who: 1.0 + t} for t, who in enumerate(acting)],
        infos=[{who: {"note": HOSTILE["info"]} for who in o} for o in observations],
        extra_model_outputs=[{who: {"vf_preds": 0.5 * t, "weights_seq_no": 0}} for t, who in enumerate(acting)],
        terminateds={"__all__": True, a: True, b: True}, len_lookback_buffer=0,
        agent_module_ids={a: HOSTILE["module"], b: "pb"},
    )
    episode.to_numpy()
    writer = RecordingWriter(run_dir, "hostile", StorageOptions())
    writer.append(1, False, b"s" * 32, 0, episodes_to_chunk([episode], sampled_at_s=1.0))
    writer.close()
    write_manifest(run_dir, {"format": "rllib_recorder", "schema_version": "3.0", "run_id": "hostile",
                             "status": "finished", "algorithm": HOSTILE["algorithm"], "api_stack": "new",
                             "env": HOSTILE["env"], "experiment": HOSTILE["experiment"],
                             "trial_name": HOSTILE["module"]})
    return run_dir
