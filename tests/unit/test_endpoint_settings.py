"""EndpointSettings: keyword changes over a base, and the process default endpoints fall back to."""

from __future__ import annotations

import dataclasses

import pytest

from hmp.transport import EndpointSettings, process_settings, set_process_settings
from hmp.transport.codec import Limits
from hmp.transport.settings import resolve


def test_changes_replace_fields_and_none_keeps_the_base():
    base = EndpointSettings(job_token="t" * 32, timeout_s=5.0)
    assert base.but() is base and base.but(job_token=None, security=None, shm=None) is base
    changed = base.but(timeout_s=2.0, job_token="", shm=False, limits=Limits(max_frames=3))
    assert (changed.timeout_s, changed.job_token, changed.shm, changed.limits.max_frames) == (2.0, "", False, 3)
    assert base.timeout_s == 5.0  # frozen: the base is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.job_token = ""  # type: ignore[misc]


def test_security_false_means_plain_and_true_keeps_the_bases_keys():
    curve = object()  # any Curve: only its identity matters here
    base = EndpointSettings(security=curve)  # type: ignore[arg-type]
    assert base.but(security=False).security is None
    assert base.but(security=True).security is curve


def test_an_unknown_setting_is_a_type_error():
    with pytest.raises(TypeError):
        EndpointSettings().but(job_tokne="x")


def test_endpoints_given_no_settings_take_the_process_ones_until_reset():
    daemon = EndpointSettings(job_token="d" * 32, timeout_s=7.0)
    set_process_settings(daemon)
    try:
        assert resolve(None, {}) is daemon
        assert resolve(None, {"timeout_s": 1.0}) == dataclasses.replace(daemon, timeout_s=1.0)
        assert resolve(EndpointSettings(), {}).job_token == ""  # explicit settings ignore the process's
    finally:
        set_process_settings(None)
    assert process_settings() == EndpointSettings()
