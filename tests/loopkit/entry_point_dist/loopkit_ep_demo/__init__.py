"""A tiny third-party loopkit plugin, installed for real by the test."""

import loopkit


@loopkit.hookimpl
def session_create(session):
    print("EP_DEMO session_create", session.step, flush=True)


@loopkit.hookimpl
def on_stop(session, error):
    print("EP_DEMO on_stop", session.step, flush=True)
