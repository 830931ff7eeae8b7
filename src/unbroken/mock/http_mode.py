"""The mock provider's HTTP mode: a provider request answered as its action says
(a reply, a status, a fault), and Responses background mode."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, MultiDict

from unbroken.mock.actions import (
    Action,
    ActionError,
    parse_action,
)
from unbroken.mock.background_store import (
    background_refused_body,
    cancelled_body,
    not_found_body,
    resume_frames,
    resume_target,
    store_required_body,
)
from unbroken.mock.state import (
    _FRAME_FAULTS,
    _RATE_HEADERS,
    ACTION_HEADER,
    JSON_CONTENT_TYPE,
    KEY_HEADER,
    SSE_CONTENT_TYPE,
    MockState,
    RecordedRequest,
    _abort,
    _flush,
    _mock_error_body,
    _previous_id,
    _remember,
)
from unbroken.mock.wire.error_replies import (
    PREFILL_REFUSED_BODY,
    garbage_frame,
    kind_error_body,
    kind_error_frame,
    status_error_body,
)
from unbroken.mock.wire.frames import ANTHROPIC_NAME, GEMINI_NAME, RESPONSES_NAME
from unbroken.mock.wire.gemini_api import parse_path as parse_gemini_path
from unbroken.mock.wire.gemini_api import request_view as gemini_request_view
from unbroken.mock.wire.render import cut_after, halves, protocol_name_for_path, render_reply
from unbroken.mock.wire.reply import MockReply, canonical_json, prefill_of
from unbroken.mock.wire.ws_replies import (
    connection_limit_body,
    previous_not_found_body,
)

__all__ = ["HttpMode"]


class HttpMode(MockState):
    """Provider requests over plain HTTP (SSE or a JSON body)."""

    async def _h_provider(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if "/v1/responses/" in path and not path.startswith("/_mock/"):
            target = resume_target(path)
            if target is not None and (request.method == "GET") != target[1]:
                return await self._h_background(request, *target)
        protocol = protocol_name_for_path(path)
        if protocol is None or path.startswith("/_mock/"):
            return web.json_response(
                {"error": {"message": f"mock: no route for {path}", "type": "not_found"}},
                status=404,
            )
        if (
            protocol == RESPONSES_NAME
            and request.method == "GET"
            and request.headers.get("Upgrade", "").lower() == "websocket"
        ):
            return await self._h_websocket(request)
        if request.method != "POST":
            return web.Response(
                status=405,
                body=status_error_body(protocol, 405),
                content_type=JSON_CONTENT_TYPE,
                headers={"Allow": "POST"},
            )
        body = await request.read()
        key = request.headers.get(KEY_HEADER)
        action: Action | None = None
        problem: str | None = None
        req_json: Any = None
        try:
            req_json = json.loads(body)
            if not isinstance(req_json, dict):
                problem = "request body must be a JSON object"
        except ValueError as exc:
            problem = f"request body is not valid JSON: {exc}"
        gemini_call = parse_gemini_path(path) if protocol == GEMINI_NAME else None
        if problem is None and gemini_call is not None and isinstance(req_json, dict):
            model, streamed = gemini_call
            if streamed and request.query.get("alt") != "sse":
                problem = "mock: streamGenerateContent is served with alt=sse only"
            req_json = gemini_request_view(req_json, model, streamed)
        if problem is None:
            raw_action = request.headers.get(ACTION_HEADER)
            try:
                action = (
                    self._header_action(raw_action)
                    if raw_action is not None
                    else self._next_action(key)
                )
            except ActionError as exc:
                problem = str(exc)
        previous: str | None = None
        found: bool | None = None
        if protocol == RESPONSES_NAME and isinstance(req_json, dict):
            previous = _previous_id(req_json)
            found = None if previous is None else previous in self._stored
        if self.record:
            self._record(
                RecordedRequest(
                    method=request.method,
                    path=path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    body=body,
                    key=key,
                    protocol=protocol,
                    action=action.raw if action is not None else None,
                    previous_response_id=previous,
                    previous_response_found=found,
                    at=asyncio.get_running_loop().time(),
                )
            )
        if action is None:
            return web.Response(
                status=400,
                body=_mock_error_body(protocol, problem or "invalid request"),
                content_type=JSON_CONTENT_TYPE,
            )
        limits = self.limits
        if limits is not None:
            max_tokens = req_json.get("max_tokens")
            status, rate_headers = limits.charge(
                request.headers,
                max(1, len(canonical_json(req_json)) // 4),
                max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
                limits.clock() if limits.clock is not None else asyncio.get_running_loop().time(),
            )
            if status == 429:
                return web.Response(
                    status=429,
                    body=status_error_body(protocol, 429),
                    content_type=JSON_CONTENT_TYPE,
                    headers=rate_headers,
                )
            request[_RATE_HEADERS] = rate_headers
        transport = request.transport
        if transport is None:
            return web.Response()
        self._active.add(transport)
        try:
            return await self._respond(
                request, protocol, action, req_json, None if found is not False else previous
            )
        except ConnectionError:
            # The client went away mid-reply; aiohttp handles this quietly.
            return web.Response()
        finally:
            self._active.discard(transport)

    async def _respond(
        self,
        request: web.Request,
        protocol: str,
        action: Action,
        req_json: dict[str, Any],
        unknown_previous: str | None = None,
    ) -> web.StreamResponse:
        if action.delay:
            await asyncio.sleep(action.delay)
        fault = action.fault
        if fault == "close_before_headers":
            _abort(request, action.rst)
            return web.Response()

        reply = MockReply(protocol, action, req_json, canonical_json(req_json))
        request_id_header = "request-id" if protocol == ANTHROPIC_NAME else "x-request-id"
        headers: CIMultiDict[str] = CIMultiDict()
        error_kind = action.error if fault == "error_event" else None

        if (
            action.body is not None
            or action.is_error_status
            or (error_kind is not None and not reply.stream)
            or fault == "connection_limit"
        ):
            # A complete (usually non-2xx) JSON response.
            if action.body is not None:
                status = action.status or 200
                payload = action.body.encode()
                ctype = (
                    JSON_CONTENT_TYPE
                    if action.body.lstrip()[:1] in ("{", "[")
                    else "text/plain; charset=utf-8"
                )
            elif error_kind is not None:
                status, payload = kind_error_body(protocol, error_kind)
                ctype = JSON_CONTENT_TYPE
            elif fault == "connection_limit":
                status, payload = 400, connection_limit_body(protocol)
                ctype = JSON_CONTENT_TYPE
            else:
                status = action.status or 500
                payload = status_error_body(protocol, status)
                ctype = JSON_CONTENT_TYPE
            headers["Content-Type"] = ctype
            headers[request_id_header] = reply.request_id
            for name, value in action.headers:
                headers[name] = value
            if fault in (None, "error_event", "connection_limit"):
                return web.Response(status=status, body=payload, headers=headers)
            return await self._send_frames(
                request, action, status, headers, halves(payload), stream=False, reply=reply
            )

        if (
            action.refuse_prefill
            and protocol == ANTHROPIC_NAME
            and prefill_of(protocol, req_json) is not None
        ):
            # Claude 4.6 and later: "This model does not support assistant message prefill"
            headers["Content-Type"] = JSON_CONTENT_TYPE
            headers[request_id_header] = reply.request_id
            return web.Response(status=400, body=PREFILL_REFUSED_BODY, headers=headers)

        if unknown_previous is not None:
            headers["Content-Type"] = JSON_CONTENT_TYPE
            headers[request_id_header] = reply.request_id
            for name, value in action.headers:
                headers[name] = value
            return web.Response(
                status=400, body=previous_not_found_body(unknown_previous), headers=headers
            )

        background = protocol == RESPONSES_NAME and req_json.get("background") is True
        if background and (action.refuse_background or req_json.get("store") is False):
            headers["Content-Type"] = JSON_CONTENT_TYPE
            headers[request_id_header] = reply.request_id
            refused = action.refuse_background
            return web.Response(
                status=400,
                body=background_refused_body() if refused else store_required_body(),
                headers=headers,
            )
        rendered = render_reply(reply)
        if background and rendered.stream:
            # It runs on whatever happens to this connection: stored whole first.
            self.background.put(reply.response_id, reply, rendered.frames)
        status = action.status or 200
        if (
            protocol == RESPONSES_NAME
            and req_json.get("store") is not False
            and (
                fault in (None, "malformed")
                or (
                    fault in _FRAME_FAULTS
                    and cut_after(reply, action, len(rendered.frames)) >= len(rendered.frames)
                )
            )
        ):
            # The whole reply goes out: remember its id before the client can see it.
            _remember(self._stored, reply.response_id)
        if rendered.stream:
            headers["Content-Type"] = SSE_CONTENT_TYPE
            headers["Cache-Control"] = "no-cache"
        else:
            headers["Content-Type"] = JSON_CONTENT_TYPE
        headers[request_id_header] = rendered.request_id
        for name, value in action.headers:
            headers[name] = value
        if fault is None and not rendered.stream:
            return web.Response(status=status, body=rendered.body, headers=headers)
        return await self._send_frames(
            request,
            action,
            status,
            headers,
            rendered.frames,
            stream=rendered.stream,
            reply=reply,
            chunked_frames=rendered.chunked,
        )

    async def _send_frames(
        self,
        request: web.Request,
        action: Action,
        status: int,
        headers: CIMultiDict[str],
        frames: tuple[bytes, ...],
        *,
        stream: bool,
        reply: MockReply,
        chunked_frames: tuple[bytes, ...] | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers=headers)
        chunked = request.version >= (1, 1)
        if chunked:
            resp.enable_chunked_encoding()
        writer = await resp.prepare(request)  # sends the headers
        transport = request.transport
        assert writer is not None
        if transport is None:
            return resp
        fault = action.fault
        if fault == "reset_after_headers":
            await _flush(request, writer)
            _abort(request, action.rst)
            return resp

        k = len(frames) if fault is None else cut_after(reply, action, len(frames))
        if fault is None and chunked and chunked_frames is not None:
            wire = chunked_frames
        else:
            seq = list(frames[:k])
            if fault == "error_event":
                seq.append(kind_error_frame(reply, action.error, k, action.error_style))
            elif fault == "malformed":
                seq.append(garbage_frame(reply.protocol, stream))
                seq.extend(frames[k:])
            wire = tuple(_chunk(f) for f in seq) if chunked else tuple(seq)
        await _pump(transport, wire, action.chunk_delay)

        if fault in ("reset", "stall"):
            await _flush(request, writer)
            if fault == "stall":
                stopping = self._stopping
                if stopping is not None and not stopping.is_set():
                    try:
                        async with asyncio.timeout(action.seconds):
                            await stopping.wait()
                    except TimeoutError:
                        pass
            _abort(request, action.rst)
            return resp
        await resp.write_eof()
        return resp

    # -- Responses background mode (`mock.background_store`) ----------------------------

    async def _h_background(
        self, request: web.Request, response_id: str, cancel: bool
    ) -> web.StreamResponse:
        """A background response's resume (``GET``) or cancel (``POST .../cancel``)."""
        key = request.headers.get(KEY_HEADER)
        body = await request.read()
        try:
            raw_action = request.headers.get(ACTION_HEADER)
            if raw_action is not None:
                action = self._header_action(raw_action)
            elif cancel:
                action = parse_action(None)  # a cancel takes no action from the queues
            else:
                action = self._next_action(key)
        except ActionError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if self.record:
            self._record(
                RecordedRequest(
                    method=request.method,
                    path=request.path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    body=body,
                    key=key,
                    protocol=RESPONSES_NAME,
                    action=action.raw,
                    at=asyncio.get_running_loop().time(),
                )
            )
        stored = self.background.get(response_id)
        json_headers = {"Content-Type": JSON_CONTENT_TYPE}
        if cancel:
            self.background.cancels.append(response_id)
            if stored is None:
                return web.Response(
                    status=404, body=not_found_body(response_id), headers=json_headers
                )
            stored.cancelled = True
            return web.Response(status=200, body=cancelled_body(response_id), headers=json_headers)
        if stored is None or action.resume == "not_found":
            return web.Response(status=404, body=not_found_body(response_id), headers=json_headers)
        if action.resume == "bad_request" or request.query.get("stream") != "true":
            return web.Response(
                status=400,
                body=_mock_error_body(RESPONSES_NAME, "mock: resume with stream=true only"),
                headers=json_headers,
            )
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            after = -1
        stored.resumes.append(after)
        headers: CIMultiDict[str] = CIMultiDict(
            {"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        if action.resume == "queued":
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            stopping = self._stopping
            if stopping is not None and not stopping.is_set():
                try:
                    async with asyncio.timeout(action.seconds):
                        await stopping.wait()
                except TimeoutError:
                    pass
            _abort(request, action.rst)
            return resp
        frames = resume_frames(stored, after, action)
        transport = request.transport
        if transport is None:
            return web.Response()
        self._active.add(transport)
        try:
            return await self._send_frames(
                request, action, 200, headers, frames, stream=True, reply=stored.reply
            )
        except ConnectionError:
            return web.Response()
        finally:
            self._active.discard(transport)


def _chunk(frame: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(frame), frame)


async def _pump(transport: asyncio.Transport, frames: tuple[bytes, ...], delay: float) -> None:
    """Write each frame with its own ``transport.write``, ``delay`` seconds apart.

    The delayed case runs as a chain of ``call_later`` callbacks instead of one
    task wake-up per frame, which keeps the per-frame cost low when thousands of
    slow streams run at once. There is no back-pressure: replies are finite and
    already in memory, so at worst the whole rest of a reply sits in the
    transport buffer.
    """
    if not frames:
        return
    if not delay:
        for frame in frames:
            if transport.is_closing():
                raise ConnectionResetError("mock: client went away")
            transport.write(frame)
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    total = len(frames)
    index = 0
    handle: asyncio.TimerHandle | None = None

    def step() -> None:
        nonlocal index, handle
        handle = None
        if done.done():
            return
        if transport.is_closing():
            done.set_exception(ConnectionResetError("mock: client went away"))
            return
        transport.write(frames[index])
        index += 1
        if index < total:
            handle = loop.call_later(delay, step)
        else:
            done.set_result(None)

    step()
    try:
        await done
    finally:
        if handle is not None:
            handle.cancel()
        if not done.done():
            done.cancel()
