"""The control channel (weight_export.control): keys, loopback decided on resolved
addresses, framed JSON (no pickles), and a listener that survives strangers while
every wait is bounded."""

import os
import socket
import threading
import time

import pytest
import torch

from megatron_ext.testing.multirank import free_port
from megatron_ext.weight_export.control import channel as control
from megatron_ext.weight_export.control.channel import KEY_ENV, ControlError
from megatron_ext.weight_export.plan.export_plan import BucketMeta, ExportPlan, PlanMismatch, TensorMeta


@pytest.fixture
def key_dir(tmp_path, monkeypatch):
    """This test's own per-user key directory, and no key in the environment."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(KEY_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("10.1.2.3", False),
        ("localhost.invalid", False),
        ("127.attacker.invalid", False),
        ("::1ab", False),
    ],
)
def test_loopback_is_decided_on_resolved_addresses(host, loopback):
    assert control.is_loopback(host) is loopback


def test_keys_explicit_env_or_a_private_per_user_file(key_dir, monkeypatch):
    assert control.resolve_key("10.1.2.3:5000", b"s3cret") == b"s3cret"
    with pytest.raises(ValueError, match=KEY_ENV):  # off loopback a key must be given
        control.resolve_key("10.1.2.3:5000")
    with pytest.raises(ValueError, match=KEY_ENV):  # a name that only looks like loopback
        control.resolve_key("127.attacker.invalid:5000")
    with pytest.raises(ControlError, match="start the engine"):  # the trainer side never creates it
        control.resolve_key("127.0.0.1:5000")
    engine = control.resolve_key("127.0.0.1:5000", create=True)
    assert len(engine) == 64 and engine == control.resolve_key("localhost:5001")
    path = key_dir / f"megatron_ext-{os.getuid()}"
    assert (path.stat().st_mode & 0o777) == 0o700 and ((path / "control.key").stat().st_mode & 0o077) == 0
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert control.resolve_key("10.1.2.3:5000") == b"from-env" == control.resolve_key("127.0.0.1:5000")
    monkeypatch.delenv(KEY_ENV)
    path.chmod(0o777)  # a key directory others may write to is refused
    with pytest.raises(ControlError, match="mode 0700"):
        control.resolve_key("127.0.0.1:5000")


def test_tensors_and_plans_travel_as_data():
    for t in (torch.randn(3, 5).to(torch.bfloat16), torch.arange(7), torch.empty(0, 4)):
        meta, blob = control.tensor_blob(t)
        assert torch.equal(control.blob_tensor(meta, blob), t)
    with pytest.raises(ControlError, match="needs 8 bytes"):
        control.blob_tensor({"dtype": "float32", "shape": [2]}, b"\0" * 7)
    with pytest.raises(ControlError, match="unknown dtype"):
        control.blob_tensor({"dtype": "object", "shape": [1]}, b"\0")
    plan = ExportPlan(
        (
            BucketMeta(
                0,
                0,
                512,
                (TensorMeta("a", torch.bfloat16, (4, 8), 0, 64), TensorMeta("b", torch.float32, (3,), 256, 12)),
            ),
        ),
        512,
    )
    back = ExportPlan.from_wire(control.from_wire(control.to_wire(plan.to_wire())))
    assert back.fingerprint == plan.fingerprint and back.buckets[0].tensors == plan.buckets[0].tensors
    bad = plan.to_wire()
    bad["buckets"][0]["tensors"][1][3] = 510  # runs past its bucket
    with pytest.raises(PlanMismatch, match="malformed"):
        ExportPlan.from_wire(bad)


def _strangers(address, port, results):
    """What a deployment meets: a health check, a port scan, garbage, a wrong key, a peer that says nothing."""
    for payload in (b"", b"GET / HTTP/1.0\r\n\r\n", b"\x00\x00\x00\x05{bad}", os.urandom(64)):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
    try:
        control.connect(address, timeout_s=5, key=b"not the key")
    except ControlError as exc:
        results["wrong_key"] = str(exc)
    silent = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()
    results["good"] = control.connect(address, timeout_s=30, what="engine")
    results["good_s"] = time.monotonic() - start
    silent.close()


def test_listener_survives_strangers_and_serves_its_trainer(key_dir):
    port = free_port()
    address = f"127.0.0.1:{port}"
    results = {}
    with control.Listener(address) as listener:
        t = threading.Thread(target=_strangers, args=(address, port, results))
        t.start()
        ch = listener.accept(60, handshake_s=2)
        t.join()
        assert listener.rejected == 6, listener.rejected  # 4 strangers, the wrong key, the silent one
    assert "refused the connection: wrong key" in results["wrong_key"], results
    assert results["good_s"] < 15, results  # the silent peer held the listener for its 2 s handshake only
    good = results["good"]
    meta, blob = control.tensor_blob(torch.arange(6.0))
    good.send("forward", tokens=meta, blobs=[blob], note="hi")
    msg = ch.recv(5)
    assert (msg.kind, msg["note"]) == ("forward", "hi")
    assert torch.equal(control.blob_tensor(msg["tokens"], msg.blobs[0]), torch.arange(6.0))
    with pytest.raises(ControlError, match="did not answer in time"):
        good.recv(0.3)
    ch.close()
    with pytest.raises(ControlError, match="closed the connection"):
        good.recv(5)
    good.close()


def test_every_wait_is_bounded_and_names_the_peer(key_dir):
    control.resolve_key("127.0.0.1:1", create=True)  # as an engine on this host would
    port = free_port()
    start = time.monotonic()
    with pytest.raises(ControlError, match=f"nothing is listening at 127.0.0.1:{port} after 1s.*is the engine running"):
        control.connect(f"127.0.0.1:{port}", timeout_s=1)
    assert time.monotonic() - start < 5
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts TCP, never speaks (a stopped engine)
        start = time.monotonic()
        with pytest.raises(ControlError, match="did not answer in time"):
            control.connect(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=2)
        assert time.monotonic() - start < 6
    with control.Listener(f"127.0.0.1:{port}") as listener:
        start = time.monotonic()
        with pytest.raises(ControlError, match=f"no trainer connected to 127.0.0.1:{port} within 1s"):
            listener.accept(1)
        assert time.monotonic() - start < 5


def _knock(address, port, results):
    """Strangers at the refit store: a health check, HTTP, a wrong frame, garbage, a wrong key, a silent peer."""
    from megatron_ext.weight_export.control.store import ControlStore

    for payload in (b"", b"GET / HTTP/1.0\r\n\r\n", b"\x00\x00\x00\x05{bad}", os.urandom(64)):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
    try:
        ControlStore(address, b"not the key", 5)
    except ControlError as exc:
        results["wrong_key"] = str(exc)
    results["silent"] = socket.create_connection(("127.0.0.1", port))


def _gloo_rank(store, rank, world, out):
    pg = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("g", store), rank, world, _td(10))
    t = torch.full((3,), float(rank + 1))
    pg.allreduce([t]).wait()
    out[rank] = (t, pg)


def _td(s):
    import datetime

    return datetime.timedelta(seconds=s)


def test_refit_store_speaks_the_control_protocol_and_survives_strangers(key_dir):
    """The refit group's store (p2p refit, broadcast group) is a torch.distributed Store over the control
    channel: a gloo group rendezvouses through it while strangers knock; they are dropped, the group is not."""
    import torch.distributed as dist

    from megatron_ext.weight_export.control.store import ControlStore, host_store

    key = b"k" * 32
    host = host_store("127.0.0.1", 0, key, timeout_s=10)
    server, port = host._server, host._server.port
    results = {}
    knock = threading.Thread(target=_knock, args=(host.address, port, results))
    out = {}
    stores = [host, ControlStore(host.address, key, 10), ControlStore(host.address, key, 10)]
    ranks = [threading.Thread(target=_gloo_rank, args=(stores[r], r, 3, out)) for r in range(3)]
    knock.start()
    for t in ranks:
        t.start()
    for t in [knock, *ranks]:
        t.join(60)
    assert all(torch.equal(out[r][0], torch.full((3,), 6.0)) for r in range(3)), out
    assert "refused the connection: wrong key" in results["wrong_key"], results
    deadline = time.monotonic() + 10
    while server.rejected < 5 and time.monotonic() < deadline:  # 4 strangers and the wrong key
        time.sleep(0.05)
    assert server.rejected >= 5, server.rejected
    results["silent"].close()
    # the operations torch and the refit use; waits are bounded and name the keys
    assert (host.add("n", 2), host.add("n", 3), host.check(["n"]), host.check(["nope"])) == (2, 5, True, False)
    assert (host.compare_set("c", b"", b"x"), host.compare_set("c", b"y", b"z"), host.get("c")) == (b"x", b"x", b"x")
    host.multi_set(["a", "b"], [b"1", b"2"])
    assert host.multi_get(["a", "b"]) == [b"1", b"2"] and host.delete_key("a") and not host.check(["a"])
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"keys \['late'\] not set within 1s"):
        host.wait(["late"], _td(1))
    assert time.monotonic() - start < 5
    other = ControlStore(host.address, key, 10)
    server.close(drop_clients=True)  # the host died
    with pytest.raises(dist.DistNetworkError, match=f"lost the refit store at {host.address}.*refit rank 0"):
        other.get("n")
    with pytest.raises(ControlError, match="nothing is listening"):
        ControlStore(host.address, key, 1)


def _other_addresses() -> list[str]:
    out = set()
    for host in (socket.gethostname(), socket.getfqdn()):
        try:
            out.update(i[4][0] for i in socket.getaddrinfo(host, None, socket.AF_INET))
        except socket.gaierror:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the interface of the default route
        try:
            s.connect(("10.255.255.255", 1))
            out.add(s.getsockname()[0])
        except OSError:
            pass
    return sorted(a for a in out if not a.startswith(("127.", "0.")))


def test_listener_binds_only_the_interface_it_is_given(key_dir):
    others = _other_addresses()
    if not others:
        pytest.skip("this machine has no non-loopback IPv4 address to probe")
    port = free_port()
    with control.Listener(f"127.0.0.1:{port}"):
        for addr in others:
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=2).close()


def test_every_refit_error_is_one_family_and_keeps_its_builtin_base():
    from megatron_ext import weight_export as wx

    family = {
        wx.ControlError: RuntimeError,
        wx.ReceiverError: RuntimeError,
        wx.PlanMismatch: ValueError,
        wx.NonFiniteWeights: ValueError,
        wx.RefitRejected: RuntimeError,
        wx.RefitGroupError: RuntimeError,
    }
    for cls, builtin in family.items():
        assert issubclass(cls, wx.RefitError) and issubclass(cls, builtin), cls
    try:
        raise wx.RefitRejected("a rank refused", reason="plan")
    except wx.RefitError as exc:  # one except clause for any refit failure
        assert exc.reason == "plan"


def test_every_configurable_transport_has_a_sender_factory():
    from megatron_ext.weight_export.config import HOOK_TRANSPORTS, TRANSPORTS
    from megatron_ext.weight_export.transports import SENDERS

    assert set(SENDERS) == set(HOOK_TRANSPORTS) and set(TRANSPORTS) - set(SENDERS) == {"p2p"}  # p2p: the reshard


def test_version_announcements_and_acks_round_trip_and_none_means_no_complete_version():
    from megatron_ext.weight_export.control import versions

    for v in (0, 1, 12345):
        assert versions.announced(versions.announcement(v).encode()) == v
        assert versions.acked(versions.ack(v).encode()) == v
    assert versions.announced(versions.announcement(None)) is None  # the trainer closed
    assert versions.acked(versions.ack(None)) is None  # no complete version
    assert versions.describe(None) == "no complete version" and versions.describe(3) == "version 3"
