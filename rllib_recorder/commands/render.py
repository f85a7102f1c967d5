"""`rllib-recorder render`: one recorded episode as a GIF or MP4 you can watch.

Image observations (Atari) are drawn straight from the stored frames: the uint8 codes as stored, the newest frame of
each stack, scaled up by whole pixels, so that each picture decodes back to the stored frame exactly. Other envs are
re-simulated from the episode's start state with the stored actions and drawn by the env's own ``rgb_array``
render; the env is found by the rules of ``replay --check`` (nothing a recording names is imported or run). Under
each picture a caption band: episode, step, reward so far, policy version. GIF through Pillow; MP4 through PyAV (the
``video`` extra, which ships its own FFmpeg).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np

from rllib_recorder.errors import ReplayError
from rllib_recorder.read.records import Episode, unbatch

CAPTION_PX = 14  # height of the caption band under each picture
FPS = 15


def pick_episode(run: Any, eps_id: str | None = None, best: bool = False, worst: bool = False) -> Episode:
    """The episode to show: ``eps_id``; the finished training episode of highest (``best``) or lowest (``worst``)
    return; else the first finished one (or the first of all, if none finished). Image observations stay codes."""
    if eps_id is not None:
        try:
            found = run.episode(eps_id)
        except KeyError:
            raise ReplayError(f"episode {eps_id!r} is not in run {run.path}; 'rllib-recorder replay {run.path} "
                              "--episodes' lists them") from None
        return next((e for e in run.episodes(decode=False) if e.eps_id == found.eps_id
                     and e.agent_id == found.agent_id), found)
    chosen, first = None, None
    for episode in run.episodes(decode=False):
        first = first or episode
        if not episode.is_done:
            continue
        if chosen is None or (best and episode.episode_return > chosen.episode_return) or \
                (worst and episode.episode_return < chosen.episode_return):
            chosen = episode
        if not (best or worst):
            break
    if chosen is None and first is None:
        raise ReplayError(f"run {run.path} holds no episodes to render")
    return chosen or first


def is_image(obs: Any) -> bool:
    """Image observations: one (H, W) or (H, W, C) array of uint8 codes per step."""
    return isinstance(obs, np.ndarray) and obs.dtype == np.uint8 and obs.ndim in (3, 4) and min(obs.shape[1:3]) >= 8


def stored_frames(episode: Episode) -> Iterator[np.ndarray]:
    """The picture the policy saw at each step: the newest frame of the stored stack (uint8, (H, W))."""
    obs = episode.obs
    for i in range(len(episode)):
        frame = obs[i]
        yield frame if frame.ndim == 2 else frame[..., -1] if frame.shape[-1] not in (3,) else frame


def simulated_frames(episode: Episode, make_env: Callable[[], Any], env_name: str) -> Iterator[np.ndarray]:
    """The env's ``rgb_array`` picture at each step, re-simulated from the start state with the stored actions."""
    from rllib_recorder.record import envstate

    if not episode.start_state_kind:
        raise ReplayError(f"episode {episode.eps_id} of {env_name} has no stored start state, so it can't be "
                          "re-simulated to draw it (recorded with record_start_states=False, or the env's state "
                          "can't be captured)")
    for name in ("SDL_VIDEODRIVER", "SDL_AUDIODRIVER"):  # pygame (gymnasium's classic-control render): no screen
        os.environ.setdefault(name, "dummy")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    env = make_env()
    try:
        env.reset(seed=0)
        envstate.restore(env, episode.start_state_kind, episode.start_state)
        for i in range(len(episode)):
            try:
                picture = env.render()
            except Exception as e:  # gymnasium's DependencyNotInstalled (pygame, mujoco, ...) or the env's own
                raise ReplayError(f"env {env_name} could not draw itself ({type(e).__name__}: {e}); install what "
                                  "it names (CartPole and the other classic-control envs: pip install "
                                  "'rllib-recorder[video]')") from None
            if not isinstance(picture, np.ndarray) or picture.ndim != 3:
                raise ReplayError(f"env {env_name} does not render an rgb_array picture (render() gave "
                                  f"{type(picture).__name__}); render needs render_mode='rgb_array'")
            yield picture
            env.step(unbatch(episode.actions, i))
    finally:
        env.close()


def captioned(frames: Iterator[np.ndarray], episode: Episode, scale: int) -> Iterator[np.ndarray]:
    """Each picture scaled up ``scale`` times (whole pixels) over a caption band: episode, step, reward so far,
    policy version. Grey pictures stay grey (H, W); colour ones (H, W, 3)."""
    from PIL import Image, ImageDraw

    so_far = np.cumsum(np.asarray(episode.rewards, np.float64))
    versions = np.asarray(episode.weights_seq_no)
    for i, frame in enumerate(frames):
        big = frame.repeat(scale, axis=0).repeat(scale, axis=1)
        band = np.zeros((CAPTION_PX,) + big.shape[1:], np.uint8)
        picture = Image.fromarray(np.concatenate([big, band]))
        version = int(versions[i]) if i < len(versions) else -1
        text = (f"ep {episode.eps_id[:10]}  step {i + 1}/{len(episode)}  return {so_far[i]:g}  "
                f"policy v{version if version >= 0 else '?'}")
        ImageDraw.Draw(picture).text((2, big.shape[0] + 1), text, fill=255 if frame.ndim == 2 else (255,) * 3)
        yield np.asarray(picture)


def write_gif(frames: Iterator[np.ndarray], path: str, fps: int = FPS) -> int:
    """Writes the pictures as a looping GIF (grey ones losslessly, with a grey palette); returns how many."""
    from PIL import Image

    images = []
    for frame in frames:
        image = Image.fromarray(frame)
        if image.mode == "L":  # a grey palette of all 256 levels: every code stays itself
            image = _grey_palette(image)
        else:
            image = image.quantize(256, method=Image.Quantize.MEDIANCUT)
        images.append(image)
    if not images:
        raise ReplayError("the episode has no steps to render")
    images[0].save(path, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0,
                   optimize=False, disposal=1)
    return len(images)


def _grey_palette(image: Any) -> Any:
    """A grey picture as palette indices equal to its levels, over the palette of all 256 greys."""
    from PIL import Image

    out = Image.frombytes("P", image.size, image.tobytes())
    out.putpalette([v for level in range(256) for v in (level, level, level)])
    return out


def write_mp4(frames: Iterator[np.ndarray], path: str, fps: int = FPS) -> int:
    """Writes the pictures as an H.264 MP4 through PyAV (the ``video`` extra); returns how many."""
    try:
        import av
    except ImportError:
        raise ReplayError("writing MP4 needs PyAV, which is not installed: pip install 'rllib-recorder[video]' "
                          "(or write a .gif)") from None
    count = 0
    with av.open(path, "w") as container:
        stream = None
        for frame in frames:
            rgb = np.repeat(frame[..., None], 3, axis=-1) if frame.ndim == 2 else frame
            height, width = (rgb.shape[0] + 1) // 2 * 2, (rgb.shape[1] + 1) // 2 * 2  # H.264 wants even sizes
            rgb = np.pad(rgb, ((0, height - rgb.shape[0]), (0, width - rgb.shape[1]), (0, 0)))
            if stream is None:
                stream = container.add_stream("libx264", rate=fps)
                stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                container.mux(packet)
            count += 1
        if stream is None:
            raise ReplayError("the episode has no steps to render")
        for packet in stream.encode():
            container.mux(packet)
    return count


def render_episode(run: Any, output: str, *, eps_id: str | None = None, best: bool = False, worst: bool = False,
                   env: str | None = None, scale: int | None = None, fps: int = FPS) -> dict[str, Any]:
    """Renders one episode of ``run`` into ``output`` (.gif or .mp4); returns what was drawn."""
    from rllib_recorder.commands.replay import env_factory_rendering

    kind = os.path.splitext(output)[1].lower()
    if kind not in (".gif", ".mp4"):
        raise ReplayError(f"{output}: render writes a .gif or an .mp4; name the output file so")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ReplayError(f"{output}: can't write there ({folder} is not a writable directory); name a file in one")
    if kind == ".mp4":
        try:
            import av  # noqa: F401 - checked before the episode is read
        except ImportError:
            raise ReplayError("writing MP4 needs PyAV, which is not installed: pip install 'rllib-recorder[video]' "
                              "(or write a .gif)") from None
    episode = pick_episode(run, eps_id, best, worst)
    if is_image(episode.obs):
        frames: Iterator[np.ndarray] = stored_frames(episode)
        source, scale = "stored frames", scale or 3
    else:
        name, make_env = env_factory_rendering(run, env)
        frames, source, scale = simulated_frames(episode, make_env, name), f"re-simulated in {name}", scale or 1
    pictures = captioned(frames, episode, scale)
    count = write_mp4(pictures, output, fps) if kind == ".mp4" else write_gif(pictures, output, fps)
    return {"eps_id": episode.eps_id, "worker_index": episode.worker_index, "steps": len(episode),
            "frames": count, "return": episode.episode_return, "source": source, "scale": scale, "output": output}
