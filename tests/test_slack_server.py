"""The local Slack server (spikeops.sim.slack) over real HTTP, with slack-sdk's WebClient as the client.

Every test talks to the server the way the notifier will talk to slack.com: an unmodified
``WebClient`` pointed at ``server.api_url``, so the SDK's own encoding, response validation
and retry handlers are what is exercised.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

from spikeops.sim.slack import DEFAULT_TOKEN, UPLOAD_CALL, SlackServer, validate_blocks

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


@pytest.fixture
def server():
    with SlackServer() as started:
        yield started


@pytest.fixture
def client(server: SlackServer) -> WebClient:
    return WebClient(token=DEFAULT_TOKEN, base_url=server.api_url, timeout=10)


def _refused(call, *args, **kwargs) -> SlackApiError:
    with pytest.raises(SlackApiError) as caught:
        call(*args, **kwargs)
    return caught.value


def _section(text: str) -> dict:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def test_auth_test_names_the_bot(client):
    answer = client.auth_test()
    assert answer["ok"] and answer["user_id"] and answer["bot_id"] and answer["team"]
    assert answer["url"].startswith("https://")


def test_a_parent_and_two_replies_read_back_as_one_thread(server, client):
    parent = client.chat_postMessage(channel="#incidents", text="loss spike at step 12345",
                                     blocks=[_section("*loss spike* at step 12345")])
    assert parent["channel"] == "C0INCIDENT"  # a name in, the id out, as Slack answers
    assert parent["message"]["text"] == "loss spike at step 12345"
    first = client.chat_postMessage(channel="C0INCIDENT", text="collecting evidence", thread_ts=parent["ts"])
    second = client.chat_postMessage(channel="C0INCIDENT", text="diagnosis: gpu_xid", thread_ts=parent["ts"])
    assert first["message"]["thread_ts"] == parent["ts"]
    assert parent["ts"] < first["ts"] < second["ts"]

    thread = server.thread(parent["ts"])
    assert [m.text for m in thread] == ["loss spike at step 12345", "collecting evidence", "diagnosis: gpu_xid"]
    assert [m.thread_ts for m in thread] == [None, parent["ts"], parent["ts"]]
    assert thread[0].blocks == [_section("*loss spike* at step 12345")]
    assert server.thread(second["ts"]) == thread  # a reply's ts finds its thread too
    assert not any(m.orphaned for m in server.messages)


def test_a_reply_to_a_parent_that_does_not_exist_is_answered_ok_but_orphaned(server, client):
    parent = client.chat_postMessage(channel="C0INCIDENT", text="parent")
    lost = client.chat_postMessage(channel="C0INCIDENT", text="lost", thread_ts="1600000000.000100")
    assert lost["ok"]  # what Slack does: ok, and nobody ever sees it
    orphan = next(m for m in server.messages if m.ts == lost["ts"])
    assert orphan.orphaned and orphan.thread_ts == "1600000000.000100"
    assert [m.text for m in server.thread(parent["ts"])] == ["parent"]
    malformed = _refused(client.chat_postMessage, channel="C0INCIDENT", text="x", thread_ts="0")
    assert malformed.response["error"] == "invalid_thread_ts"


def test_chat_update_edits_the_parent_and_records_the_edit(server, client):
    parent = client.chat_postMessage(channel="C0INCIDENT", text="investigating", blocks=[_section("investigating")])
    client.chat_postMessage(channel="C0INCIDENT", text="reply", thread_ts=parent["ts"])
    updated = client.chat_update(channel="C0INCIDENT", ts=parent["ts"], text="resolved: gpu-003 drained",
                                 blocks=[_section("*resolved*: gpu-003 drained")])
    assert updated["ts"] == parent["ts"] and updated["text"] == "resolved: gpu-003 drained"
    assert "edited" in updated["message"]

    head = server.thread(parent["ts"])[0]
    assert head.updated and head.text == "resolved: gpu-003 drained"
    assert head.blocks == [_section("*resolved*: gpu-003 drained")]
    assert len(head.edits) == 1
    assert head.edits[0].old_text == "investigating" and head.edits[0].old_blocks == [_section("investigating")]
    assert len(server.messages) == 2  # edited in place, nothing new posted

    missing = _refused(client.chat_update, channel="C0INCIDENT", ts="1600000000.000100", text="x")
    assert missing.response["error"] == "message_not_found"


@pytest.mark.parametrize(("kwargs", "error", "detail"), [
    ({"blocks": [_section(f"block {n}") for n in range(51)]}, "invalid_blocks",
     "[ERROR] no more than 50 items allowed [json-pointer:/blocks]"),
    ({"blocks": [_section("x" * 3001)]}, "invalid_blocks",
     "[ERROR] must be less than 3001 characters [json-pointer:/blocks/0/text/text]"),
    ({"blocks": [_section("ok"), {"type": "header", "text": {"type": "plain_text", "text": "h" * 151}}]},
     "invalid_blocks", "[ERROR] must be less than 151 characters [json-pointer:/blocks/1/text/text]"),
    ({"text": "t" * 40_001}, "msg_too_long", None),
    ({"blocks": "[{\"type\": \"section\""}, "invalid_blocks_format", None),
])
def test_blocks_and_text_over_slacks_limits_are_refused_as_slack_refuses_them(server, client, kwargs, error,
                                                                               detail):
    arguments = {"channel": "C0INCIDENT", "text": "fallback", **kwargs}
    refused = _refused(client.chat_postMessage, **arguments)
    assert refused.response.status_code == 200
    assert refused.response["error"] == error
    if detail is not None:
        assert detail in refused.response["response_metadata"]["messages"]
    assert server.messages == []
    assert server.calls[-1].error == error


def test_blocks_at_the_limits_are_accepted(client):
    at_limits = [{"type": "header", "text": {"type": "plain_text", "text": "h" * 150}}, _section("x" * 3000)]
    at_limits += [{"type": "divider"}] * 48
    assert client.chat_postMessage(channel="C0INCIDENT", text="t" * 40_000, blocks=at_limits)["ok"]
    assert validate_blocks(at_limits) == []


def test_form_encoded_blocks_are_a_json_string(server, client):
    # chat_postMessage sends JSON; other callers send a form, where blocks is a JSON string.
    client.api_call("chat.postMessage", params={"channel": "C0INCIDENT", "text": "form",
                                                "blocks": json.dumps([_section("form")])})
    assert server.messages[0].blocks == [_section("form")]
    refused = _refused(client.api_call, "chat.postMessage",
                       params={"channel": "C0INCIDENT", "text": "form", "blocks": "[oops"})
    assert refused.response["error"] == "invalid_blocks_format"


def test_files_upload_v2_into_a_thread_records_bytes_filename_and_thread(server, client):
    parent = client.chat_postMessage(channel="C0INCIDENT", text="incident inc-4412")
    answer = client.files_upload_v2(channel="C0INCIDENT", thread_ts=parent["ts"], file=PNG,
                                    filename="loss.png", title="Loss curve", initial_comment="the spike")
    assert answer["file"]["id"] == answer["files"][0]["id"]

    (uploaded,) = server.files
    assert uploaded.file_id == answer["file"]["id"]
    assert uploaded.bytes == PNG and uploaded.filename == "loss.png" and uploaded.title == "Loss curve"
    assert uploaded.channel == "C0INCIDENT" and uploaded.thread_ts == parent["ts"]
    assert uploaded.initial_comment == "the spike"
    shared = server.thread(parent["ts"])[1]
    assert shared.files == (uploaded.file_id,) and shared.text == "the spike"
    assert [c.method for c in server.calls][-3:] == ["files.getUploadURLExternal", UPLOAD_CALL,
                                                    "files.completeUploadExternal"]


def test_upload_bytes_must_match_the_promised_length_and_ids_must_be_uploaded(server, client):
    ticket = client.files_getUploadURLExternal(filename="x.bin", length=10)
    assert ticket["upload_url"].startswith(server.base_url)
    short = urllib.request.Request(ticket["upload_url"], data=b"12345", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(short, timeout=10)
    assert caught.value.code == 400
    refused = _refused(client.files_completeUploadExternal, files=[{"id": ticket["file_id"]}],
                       channel_id="C0INCIDENT")
    assert refused.response["error"] == "file_not_found"
    assert server.files == []


def test_a_rate_limited_call_succeeds_after_retry_after_with_the_retry_handler(server):
    server.fail_next("chat.postMessage", retry_after=1)
    patient = WebClient(token=DEFAULT_TOKEN, base_url=server.api_url, timeout=10,
                        retry_handlers=[RateLimitErrorRetryHandler(max_retry_count=2)])
    started = time.monotonic()
    assert patient.chat_postMessage(channel="C0INCIDENT", text="after the wait")["ok"]
    assert time.monotonic() - started >= 1.0
    assert [(c.method, c.status, c.error) for c in server.calls] == [
        ("chat.postMessage", 429, "ratelimited"), ("chat.postMessage", 200, None)]
    assert [m.text for m in server.messages] == ["after the wait"]


def test_a_rate_limited_call_without_the_handler_gets_429_and_retry_after(server, client):
    server.fail_next("chat.postMessage", retry_after=1)
    refused = _refused(client.chat_postMessage, channel="C0INCIDENT", text="too soon")
    assert refused.response.status_code == 429
    assert refused.response.headers["Retry-After"] == "1"
    assert refused.response["error"] == "ratelimited"
    assert server.messages == []
    assert client.chat_postMessage(channel="C0INCIDENT", text="later")["ok"]  # only the next call failed


def test_authentication_errors_are_http_200_with_slacks_codes(server, client):
    anonymous = WebClient(base_url=server.api_url, timeout=10)
    assert _refused(anonymous.auth_test).response["error"] == "not_authed"
    stranger = WebClient(token="xoxb-someone-else", base_url=server.api_url, timeout=10)
    wrong = _refused(stranger.chat_postMessage, channel="C0INCIDENT", text="x")
    assert (wrong.response.status_code, wrong.response["error"]) == (200, "invalid_auth")

    assert client.auth_test()["ok"]
    server.revoke_token()
    revoked = _refused(client.chat_postMessage, channel="C0INCIDENT", text="x")
    assert (revoked.response.status_code, revoked.response["error"]) == (200, "token_revoked")
    assert server.messages == []


def test_unknown_methods_and_channels(client):
    unknown = _refused(client.api_call, "spikeops.page")
    assert (unknown.response["error"], unknown.response["req_method"]) == ("unknown_method", "spikeops.page")
    assert _refused(client.chat_postMessage, channel="#random", text="x").response["error"] == "channel_not_found"
    with pytest.warns(UserWarning, match="text"):  # slack-sdk warns too, before Slack refuses
        assert _refused(client.chat_postMessage, channel="C0INCIDENT").response["error"] == "no_text"


def test_recorded_calls_never_hold_the_token(server, client):
    token = DEFAULT_TOKEN
    client.auth_test()
    client.chat_postMessage(channel="C0INCIDENT", text="hello")
    client.files_upload_v2(channel="C0INCIDENT", content="log line\n", filename="log.txt")
    # A form body may carry the token as a field, as Slack also accepts.
    form = urllib.parse.urlencode({"token": token, "channel": "C0INCIDENT", "text": "form"}).encode()
    with urllib.request.urlopen(urllib.request.Request(server.api_url + "chat.postMessage", data=form),
                                timeout=10) as answer:
        assert json.load(answer)["ok"]

    calls = server.calls
    assert calls and all(token not in repr(call) for call in calls)
    header = next(v for k, v in calls[0].headers.items() if k.lower() == "authorization")
    assert header == f"Bearer <len {len(token)}>"
    assert calls[-1].params["token"] == f"<len {len(token)}>"
