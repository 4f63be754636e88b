"""A caller's request never reaches a ``task-sent`` event or a message header in the clear.

Celery builds the ``task-sent`` event (sent when ``task_send_sent_event`` is on) with the
message, from the message's ``argsrepr``: this app's message factory writes the request's size
there as the message is made, so the event and the headers both carry only the size.
"""

from __future__ import annotations

from gpuhedge_celery import hedged_infer
from gpuhedge_celery.names import TASK_HEDGED_INFER

SECRET = "SSN 078-05-1120"


def test_the_sent_event_and_the_headers_carry_the_requests_size_only():
    request = {"text": f"read this aloud: {SECRET}"}
    message = hedged_infer.app.amqp.create_task_message(
        "t-1", TASK_HEDGED_INFER, (request,), {"policy": "hedge:p->h@1s"}, create_sent_event=True
    )
    headers, event = message.headers, message.sent_event
    assert event is not None and "bytes>" in event["args"] and SECRET not in str(event)
    assert headers["argsrepr"] == event["args"] and SECRET not in str(headers)
    assert "hedge:p->h@1s" in event["kwargs"]  # the other arguments are shown as they are


def test_an_ordinary_task_keeps_celerys_repr():
    message = hedged_infer.app.amqp.create_task_message(
        "t-2", "celery.ping", (SECRET,), {}, create_sent_event=True
    )
    assert SECRET in message.sent_event["args"]
