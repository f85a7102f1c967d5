"""`rllib-recorder view` in a real browser (Debian's chromium, headless, driven by Playwright): the runs page
lists the runs with open_run's episode counts; a deep link to step t of a Breakout episode draws exactly the
stored frame t (canvas pixels read back) beside the stored reward and action; keys and play move the step; a run
that records gains episodes on the page without a reload; a hostile recording's strings are shown as text and
never run. Every page load checks that no request left 127.0.0.1 and that the console shows no error.

The README's screenshot is made here: ``RLLIB_RECORDER_SCREENSHOT=docs/view.png python -m pytest -q
tests/test_view_browser.py -k deep_link`` writes it (without the variable it goes to the test's temp dir).
"""

from __future__ import annotations

import os
import time
import urllib.parse
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from rllib_recorder import open_run
from tests.view_runs import HOSTILE, hostile_run, served

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)", allow_module_level=True)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_ENV = "RLLIB_RECORDER_SCREENSHOT"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def both(recorded_cartpole, recorded_breakout):
    with served(recorded_cartpole, recorded_breakout) as server:
        yield server, {path: run_id for run_id, path in server.catalog.scan().items()}


@contextmanager
def watched(browser: Any, server: Any) -> Iterator[tuple[Any, dict[str, list[str]]]]:
    """A page whose every request, console error, uncaught error and dialog is logged; a request for anything
    but the viewer's own address is refused. On leaving: none left 127.0.0.1, no error, no dialog."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    log: dict[str, list[str]] = {"requests": [], "outside": [], "errors": [], "dialogs": []}
    page.on("request", lambda request: log["requests"].append(request.url))
    page.on("console", lambda message: log["errors"].append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: log["errors"].append(str(error)))
    page.on("dialog", lambda dialog: (log["dialogs"].append(dialog.message), dialog.dismiss()))

    def route(r: Any) -> None:
        if r.request.url.startswith(server.url):
            r.continue_()
        else:
            log["outside"].append(r.request.url)
            r.abort()

    context.route("**/*", route)
    try:
        yield page, log
    finally:
        context.close()
    assert log["outside"] == [] and all(url.startswith(server.url) for url in log["requests"]), log["requests"]
    assert log["errors"] == [] and log["dialogs"] == []


def open_page(page: Any, server: Any, ready: str, **query: Any) -> None:
    page.goto(server.url + ("?" + urllib.parse.urlencode(query) if query else ""))
    page.wait_for_selector(f"body[data-ready={ready}]", state="attached", timeout=60_000)


def until(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Polls ``check`` until it is true (the page's CSP refuses Playwright's wait_for_function: it evaluates)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def canvas_pixels(page: Any) -> np.ndarray:
    size, data = page.evaluate("() => { const c = document.getElementById('frame');"
                               " return [[c.height, c.width], Array.from(c.getContext('2d')"
                               ".getImageData(0, 0, c.width, c.height).data)]; }")
    return np.array(data, np.uint8).reshape(*size, 4)


def test_the_runs_page_lists_every_run_with_open_runs_episode_counts(browser, both):
    server, ids = both
    with watched(browser, server) as (page, _):
        open_page(page, server, "runs")
        shown = page.evaluate("() => Array.from(document.querySelectorAll('tr.run')).map(r => "
                              "[r.dataset.run, r.querySelector('td.episodes').textContent, r.querySelector('td.status').textContent])")
        assert sorted(run_id for run_id, *_ in shown) == sorted(ids.values())
        for path, run_id in ids.items():
            with open_run(path) as run:
                episodes = run.counts()["episodes"]
            assert [(e, s) for i, e, s in shown if i == run_id] == [(str(episodes), "finished")]
        until(lambda: page.evaluate("() => Array.from(document.querySelectorAll('td.verdict'))"
                                    ".every(c => c.textContent === 'sound')"), what="verify's verdicts")


def stored_breakout_episode(run_dir: str) -> Any:
    """The finished episode of highest return (the first such) of more than 20 steps, frames as stored."""
    with open_run(run_dir) as run:
        episodes = [e for e in run.episodes(decode=False) if e.is_done and len(e) > 20]
        return max(episodes, key=lambda e: e.episode_return)


def test_a_deep_link_draws_the_stored_breakout_frame_and_its_values_and_keys_move_the_step(browser, both,
                                                                                           recorded_breakout, tmp_path):
    server, ids = both
    episode = stored_breakout_episode(recorded_breakout)
    frames = episode.obs[:len(episode), ..., -1]  # the newest frame of each stored stack: uint8 as stored
    t = len(episode) // 2
    with watched(browser, server) as (page, _):
        open_page(page, server, "episode", run=ids[recorded_breakout], file=f"worker-{episode.worker_index:03d}.h5",
                  episode=episode.eps_id, t=t)
        pixels = canvas_pixels(page)
        for channel in range(3):  # grey, drawn as it is stored
            np.testing.assert_array_equal(pixels[..., channel], frames[t])
        assert (pixels[..., 3] == 255).all()
        value = lambda column: page.text_content(f'td[data-column="{column}"]')  # noqa: E731
        assert float(value("rewards")) == episode.rewards[t] and value("actions") == str(int(episode.actions[t]))
        assert page.input_value("#slider") == str(t)
        shot = os.environ.get(SCREENSHOT_ENV) or str(tmp_path / "view.png")
        page.screenshot(path=shot)
        page.keyboard.press("ArrowRight")
        until(lambda: page.evaluate("() => window.viewer.shown") == t + 1, what="step t + 1 drawn")
        np.testing.assert_array_equal(canvas_pixels(page)[..., 0], frames[t + 1])
        assert value("actions") == str(int(episode.actions[t + 1]))
        until(lambda: f"t={t + 1}" in page.evaluate("() => location.search"), what="the URL to hold t + 1")
        page.keyboard.press("ArrowLeft")
        until(lambda: page.evaluate("() => window.viewer.shown") == t, what="step t drawn again")
        page.keyboard.press(" ")  # play ...
        until(lambda: page.evaluate("() => window.viewer.t") > t + 2, what="playing")
        page.keyboard.press(" ")  # ... and pause
        stopped = page.evaluate("() => window.viewer.t")
        time.sleep(0.3)
        assert page.evaluate("() => window.viewer.t") == stopped
        shown = page.evaluate("() => window.viewer.shown")
        np.testing.assert_array_equal(canvas_pixels(page)[..., 0], frames[shown])


def test_a_recording_run_gains_episodes_on_the_page_without_a_reload(ray_session, browser, tmp_path):
    from ray.rllib.algorithms.ppo import PPOConfig

    from rllib_recorder import RecorderCallback

    config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, rollout_fragment_length=100)
              .training(train_batch_size=200, minibatch_size=100, num_epochs=1)
              .callbacks(RecorderCallback.configured(output_dir=str(tmp_path), coalesce_s=0.5)))
    algo = config.build_algo()
    stopped = False
    try:
        run_dir = algo.train()["recorder"]["run_dir"]
        until(lambda: open_run(run_dir).counts()["episodes"] > 0, what="the first commit")
        with served(run_dir) as server, watched(browser, server) as (page, _):
            (run_id,) = server.catalog.scan()
            open_page(page, server, "run", run=run_id)
            assert page.text_content("#run-status").startswith("recording")
            episodes = lambda: int(page.text_content("#run-episodes"))  # noqa: E731
            rows = lambda: page.text_content("#episodes-total")  # noqa: E731
            before, table_before = episodes(), rows()
            page.evaluate("() => { window.__sameDocument = true; }")
            algo.train()
            until(lambda: episodes() > before, timeout_s=60, what="new episodes on the page")
            until(lambda: rows() != table_before, timeout_s=30, what="the table to gain them")
            algo.stop()
            stopped = True
            until(lambda: page.text_content("#run-status") == "finished", timeout_s=60, what="the run's end")
            with open_run(run_dir) as run:
                assert episodes() == run.counts()["episodes"]
            assert page.evaluate("() => window.__sameDocument") is True  # the same page all along: no reload
    finally:
        if not stopped:
            algo.stop()


def test_a_hostile_recordings_strings_are_shown_as_text_and_never_run(browser, tmp_path):
    run_dir = hostile_run(str(tmp_path))
    with served(tmp_path) as server, watched(browser, server) as (page, _):
        run_id = f"{HOSTILE['experiment']}/{os.path.basename(run_dir)}"
        pages = [("runs", {}, ["experiment", "env"]), ("runs", {"compare": run_id}, ["experiment"]),
                 ("run", {"run": run_id}, ["algorithm", "env", "agent", "eps_id", "module"]),
                 ("episode", {"run": run_id, "file": "worker-001.h5", "episode": HOSTILE["eps_id"], "t": 2},
                  ["eps_id", "agent", "info"])]
        for ready, query, shown in pages:
            open_page(page, server, ready, **query)
            page.mouse.move(300, 300)
            text = page.evaluate("() => document.body.innerText")
            for key in shown:
                assert HOSTILE[key] in text, (ready, key)
            assert page.evaluate("() => window.__pwned") is None, ready
            assert page.evaluate("() => document.querySelectorAll('main script, main img, main svg, main iframe')"
                                 ".length + Array.from(document.querySelectorAll('*')).filter(e => Array.from("
                                 "e.attributes).some(a => a.name.startsWith('on'))).length") == 0, ready
        # one track per agent: the values at step 2 name both, the one that did not act says when it last did
        assert page.evaluate("() => document.querySelectorAll('#values tr.group').length") == 2
