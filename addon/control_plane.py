"""The episode end: ``POST /polar/<episode_id>/end``, and ``GET /polar/@control`` (whether this
proxy holds a control secret: the rollout node refuses an open one) (mitmproxy addon).

Answered here, never forwarded (access.py has checked the control secret and the body's size).
The body is parsed bounded (polar_contracts/control.py: depth, a finite reward within
``polar_max_abs_reward``); anything that raises is answered with an error, never passed on.
"""
from __future__ import annotations

import asyncio
import json
import logging

from mitmproxy import ctx, exceptions, http

from addon.access import Access, fail_closed
from addon.open_logs import EpisodeFinished, TooManyEpisodes
from addon.proxy_state import ROUTE, ProxyState, error_response, json_response
from addon.routing import END_KIND, STATUS
from polar_contracts.control import MAX_ABS_REWARD, ControlRequestError, parse_end_body, status_body
from polar_contracts.log.table import LogError

log = logging.getLogger("polar")


class ControlPlane:
    def __init__(self, state: ProxyState, access: Access) -> None:
        self.state = state
        self.access = access

    def load(self, loader) -> None:
        loader.add_option("polar_end_wait_ms", int, 5000,
                          "POST /polar/<id>/end with calls of the episode still in flight: milliseconds to wait "
                          "for them before answering 202 (the end record is written after the last one either way).")
        loader.add_option("polar_max_abs_reward", float, MAX_ABS_REWARD,
                          "Refuse (400) an episode end whose reward is larger than this in absolute value (a finite "
                          "1e308 still overflows the trainer's group statistics).")

    def configure(self, updated) -> None:
        o = ctx.options
        if "polar_end_wait_ms" in updated and o.polar_end_wait_ms < 0:
            raise exceptions.OptionsError(f"polar_end_wait_ms must be >= 0, not {o.polar_end_wait_ms}")
        if "polar_max_abs_reward" in updated and not 0 < o.polar_max_abs_reward <= 1e300:
            raise exceptions.OptionsError(f"polar_max_abs_reward must be in (0, 1e300], not {o.polar_max_abs_reward}")

    async def request(self, flow: http.HTTPFlow) -> None:
        r = flow.metadata.get(ROUTE)
        if flow.response is not None or r is None:
            return
        if r.kind == STATUS:  # (access.py checked the secret, as for every /polar/@ path)
            flow.response = json_response(200, status_body(self.state.secret is not None))
            return
        if r.kind != END_KIND:
            return
        try:
            await self._end_episode(flow, r.episode_id)
        except Exception as exc:  # noqa: BLE001 - fail closed: answered, never forwarded
            fail_closed(self.access, flow, "episode end", exc)
        if flow.response is None:  # (every path above answers; this one never lets it through)
            self.access.refuse(flow, 500, "polar proxy gave no answer to this episode end; it was not forwarded")

    async def _end_episode(self, flow: http.HTTPFlow, episode_id: str) -> None:
        """Write the end record. With calls of the episode still in flight, the end record waits
        for the last one's row (open_logs.py); the answer waits up to polar_end_wait_ms for
        that, then says 202 ``"ended": false`` (the end record still follows the last call)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_end(n: int | BaseException) -> None:
            def settle() -> None:
                if not done.done():
                    if isinstance(n, BaseException):  # the deferred end record could not be written
                        done.set_exception(n)
                    else:
                        done.set_result(n)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed (shutdown): nobody waits any more
                pass

        try:
            reward, meta = parse_end_body(flow.request.content or b"", ctx.options.polar_max_abs_reward,
                                          ctx.options.polar_max_control_body)
            meta = self._scrubbed(meta)
            n = self.state.episodes.end(episode_id, reward, meta, on_end)
        except ControlRequestError as exc:
            self.access.refuse(flow, exc.status, str(exc))
            return
        except EpisodeFinished as exc:
            flow.response = error_response(409, str(exc))
            return
        except TooManyEpisodes as exc:
            self.access.refuse(flow, 503, str(exc))
            return
        except (OSError, LogError) as exc:  # the end record is not on disk: the caller may retry
            log.error("polar: episode %s: end record not written: %s", episode_id, exc)
            flow.response = error_response(503, f"polar proxy could not write the end record of episode "
                                                f"{episode_id!r} ({type(exc).__name__}: {exc}); retry the end")
            return
        if n is None:
            pending = self.state.episodes.inflight(episode_id)
            try:
                n = await asyncio.wait_for(asyncio.shield(done), ctx.options.polar_end_wait_ms / 1000)
            except TimeoutError:
                flow.response = json_response(202, {
                    "episode_id": episode_id, "reward": reward, "ended": False, "pending_calls": pending,
                    "message": "calls of this episode are still in flight; the end record is written "
                               "after the last one's row"})
                return
            except (OSError, LogError) as exc:  # (after TimeoutError: an OSError subclass)
                log.error("polar: episode %s: end record not written: %s", episode_id, exc)
                flow.response = error_response(503, f"polar proxy could not write the end record of episode "
                                                    f"{episode_id!r} ({type(exc).__name__}: {exc}); retry the end")
                return
        flow.response = json_response(200, {"episode_id": episode_id, "calls": n, "reward": reward, "ended": True})

    def _scrubbed(self, meta: dict) -> dict:
        """The end metadata with every known credential scrubbed (a harness's stderr tail in the
        reason may quote a key)."""
        scrub = self.state.credentials.scrubber()
        if not scrub.forms:
            return meta
        text = json.dumps(meta, ensure_ascii=False)
        clean = scrub(text)
        return meta if clean == text else json.loads(clean)
