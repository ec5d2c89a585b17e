"""The control channel unpickles messages: a listener reachable from other hosts
needs a shared secret, never the built-in default."""

import pytest

from megatron_ext.weight_export.transport import AUTHKEY_ENV, DEFAULT_AUTHKEY, resolve_authkey


def test_loopback_uses_the_default_key(monkeypatch):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    assert resolve_authkey(None, "127.0.0.1:5000") == DEFAULT_AUTHKEY
    assert resolve_authkey(None, "localhost:5000") == DEFAULT_AUTHKEY


def test_other_hosts_need_a_secret(monkeypatch):
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    with pytest.raises(ValueError, match=AUTHKEY_ENV):
        resolve_authkey(None, "10.1.2.3:5000")
    assert resolve_authkey(b"s3cret", "10.1.2.3:5000") == b"s3cret"
    monkeypatch.setenv(AUTHKEY_ENV, "from-env")
    assert resolve_authkey(None, "10.1.2.3:5000") == b"from-env"
    assert resolve_authkey(None, "127.0.0.1:5000") == b"from-env"
