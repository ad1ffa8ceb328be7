"""Trust between tiers, attacked over real gRPC on 127.0.0.1: a rogue registration, an id
hijack, unauthenticated worker RPCs, forged KV into someone else's reservation, a worker
with other weights, duplicate client request ids; mTLS with certificates made here; and an
idle channel that must not collect GOAWAY too_many_pings."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
from pathlib import Path

import grpc
import pytest
from conftest import tiny_engine
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import fingerprint, rpc
from pdserve.client import PdserveClient
from pdserve.cluster_auth import TOKEN_METADATA, ClusterCredentials
from pdserve.convert import kv_spec_to_proto
from pdserve.gateway.registry import Role
from pdserve.gateway.server import Gateway, GatewayConfig
from pdserve.kvtransfer.receiver import SECRET_METADATA
from pdserve.protocol import SamplingParams
from pdserve.protos.pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.worker_runtime import WorkerConfig

TOKEN = "s3cret-cluster-token-for-tests"
CREDS = ClusterCredentials(token=TOKEN)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 140))


async def _worker(kind: str, model_dir: str, creds: ClusterCredentials, gateway: str | None):
    from pdserve.decode_worker.server import DecodeWorker
    from pdserve.prefill_worker.server import PrefillWorker

    engine = tiny_engine(model_dir, num_threads=1)
    cls = DecodeWorker if kind == "decode" else PrefillWorker
    w = cls(WorkerConfig(engine=engine.config, credentials=creds,
                         gateways=(gateway,) if gateway else (),
                         heartbeat_interval_s=0.3), engine=engine)
    await w.start()
    return w


async def _cluster(model_dir: str, creds: ClusterCredentials = CREDS, n_prefill: int = 1,
                   **gw):
    g = Gateway(GatewayConfig(model=model_dir, http_port=0, grpc_port=0, credentials=creds,
                              **gw))
    await g.start()
    workers = [await _worker("prefill", model_dir, creds, g.registry_address)
               for _ in range(n_prefill)]
    workers.append(await _worker("decode", model_dir, creds, g.registry_address))
    for _ in range(200):
        if len(g.registry.alive(Role.DECODE)) + len(g.registry.alive(Role.PREFILL)) == \
                len(workers):
            break
        await asyncio.sleep(0.05)
    return g, workers


async def _stop(g, workers) -> None:
    for w in workers:
        await w.stop(0)
    await g.stop(0.5)


def _info(worker_id: str, address: str, fp: fingerprint.Fingerprint, engine
          ) -> gateway_pb2.WorkerInfo:
    return gateway_pb2.WorkerInfo(
        worker_id=worker_id, role=gateway_pb2.WORKER_ROLE_DECODE, address=address,
        model="x", kv_spec=kv_spec_to_proto(engine.kv_spec),
        load=common_pb2.WorkerLoad(free_blocks=10**6, total_blocks=10**6),
        fingerprint=fingerprint.to_proto(fp))


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def _free(w) -> tuple[int, int]:
    s = await w.stats()
    return s.load.free_blocks, s.load.total_blocks


# ---------------------------------------------------------------------------- registry


def test_registry_refuses_rogues_hijacks_and_other_models(tiny_model_dir, tmp_path):
    async def main():
        g, (pre, dec) = await _cluster(tiny_model_dir)
        try:
            good_fp = dec.fingerprint
            rogue = _info("rogue", "127.0.0.1:1", good_fp, dec.engine)
            # the public port has no registry at all
            async with grpc.aio.insecure_channel(g.grpc_address) as ch:
                public = gateway_pb2_grpc.WorkerRegistryStub(ch)
                assert await _code(public.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    worker=rogue))) == grpc.StatusCode.UNIMPLEMENTED
            # the registry listener: no token, a wrong token
            async with grpc.aio.insecure_channel(g.registry_address) as ch:
                reg = gateway_pb2_grpc.WorkerRegistryStub(ch)
                req = gateway_pb2.RegisterWorkerRequest(worker=rogue)
                assert await _code(reg.RegisterWorker(req)) == grpc.StatusCode.UNAUTHENTICATED
                assert await _code(reg.RegisterWorker(req, metadata=(
                    (TOKEN_METADATA, TOKEN + "x"),))) == grpc.StatusCode.UNAUTHENTICATED
                assert await _code(reg.Deregister(gateway_pb2.DeregisterRequest(
                    worker_id=dec.worker_id))) == grpc.StatusCode.UNAUTHENTICATED
                # health stays open for probes
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert h.status == health_pb2.HealthCheckResponse.SERVING
            async with rpc.aio_channel(g.registry_address, CREDS) as ch:
                reg = gateway_pb2_grpc.WorkerRegistryStub(ch)
                # a member cannot take over another's id from another address
                hijack = _info(dec.worker_id, "127.0.0.1:1", good_fp, dec.engine)
                assert await _code(reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    worker=hijack))) == grpc.StatusCode.PERMISSION_DENIED
                # other weights, tokenizer or protocol: refused
                for bad in (fingerprint.Fingerprint("0" * 64, good_fp.tokenizer_sha256),
                            fingerprint.Fingerprint(good_fp.weights_sha256, "0" * 64),
                            fingerprint.Fingerprint(good_fp.weights_sha256,
                                                    good_fp.tokenizer_sha256, 1)):
                    other = _info("other", "127.0.0.1:2", bad, dec.engine)
                    assert await _code(reg.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                        worker=other))) == grpc.StatusCode.FAILED_PRECONDITION
            await asyncio.sleep(0.5)  # heartbeats of the real worker keep flowing
            assert [w.address for w in g.registry.alive(Role.DECODE)] == [dec.address]
            assert {w.worker_id for w in g.registry.all()} == {pre.worker_id, dec.worker_id}
        finally:
            await _stop(g, [pre, dec])

    asyncio.run(main())


def test_fingerprint_tells_checkpoints_apart(tiny_model_dir, tmp_path):
    """Same config and tokenizer, other weights (a fine-tune changes every tensor)."""
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (weights,) = other.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header, len(data), 4096):
        data[i] ^= 0x01
    weights.write_bytes(bytes(data))
    a, b = fingerprint.of_model(tiny_model_dir), fingerprint.of_model(str(other))
    assert a.differences(b) == ["weights_sha256"]
    assert a == fingerprint.of_model(str(Path(tiny_model_dir)))


# ---------------------------------------------------------------------------- worker RPCs


def test_worker_rpcs_refuse_callers_without_the_token(tiny_model_dir):
    async def main():
        dec = await _worker("decode", tiny_model_dir, CREDS, None)
        pre = await _worker("prefill", tiny_model_dir, CREDS, None)
        try:
            async with grpc.aio.insecure_channel(dec.address) as dch, \
                    grpc.aio.insecure_channel(pre.address) as pch:
                d = decode_pb2_grpc.DecodeWorkerStub(dch)
                p = prefill_pb2_grpc.PrefillWorkerStub(pch)
                kv = kvtransfer_pb2_grpc.KVTransferStub(dch)
                wrong = ((TOKEN_METADATA, "guess"),)

                async def push(md=()):
                    async def msgs():
                        yield kvtransfer_pb2.KVMessage(abort=kvtransfer_pb2.KVAbort(
                            reservation_id="r"))
                    return await kv.Push(msgs(), metadata=md)

                calls = {
                    "Reserve": lambda md: d.Reserve(decode_pb2.ReserveRequest(
                        request_id="x", prompt_token_ids=PROMPT,
                        sampling=GREEDY.to_proto()), metadata=md),
                    "Cancel": lambda md: d.Cancel(decode_pb2.CancelRequest(request_id="x"),
                                                  metadata=md),
                    "decode Stats": lambda md: d.Stats(common_pb2.StatsRequest(), metadata=md),
                    "prefill Stats": lambda md: p.Stats(common_pb2.StatsRequest(),
                                                        metadata=md),
                    "Prefill": lambda md: p.Prefill(prefill_pb2.PrefillRequest(
                        request_id="x", prompt_token_ids=PROMPT, decode_address=dec.address,
                        reservation_id="r"), metadata=md),
                    "Push": push,
                    "Generate": lambda md: _drain(d.Generate(
                        decode_pb2.ColocatedGenerateRequest(
                            request_id="x", prompt_token_ids=PROMPT,
                            sampling=GREEDY.to_proto()), metadata=md)),
                }
                for name, call in calls.items():
                    for md in ((), wrong):
                        assert await _code(call(md)) == grpc.StatusCode.UNAUTHENTICATED, name
                for ch in (dch, pch):  # probes need no token
                    h = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest())
                    assert h.status == health_pb2.HealthCheckResponse.SERVING
            # with the token the same channel works
            async with rpc.aio_channel(dec.address, CREDS) as ch:
                s = await decode_pb2_grpc.DecodeWorkerStub(ch).Stats(common_pb2.StatsRequest())
                assert s.worker_id == dec.worker_id
            assert await _free(dec) == (dec.engine.pool.stats().total,) * 2
        finally:
            await dec.stop(0)
            await pre.stop(0)

    asyncio.run(main())


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_forged_kv_is_refused_and_the_reservation_survives(tiny_model_dir):
    """A member that knows a reservation id but not its secret writes nothing; the
    rightful prefill then fills it and the output is the colocated one."""
    from pdserve.kvtransfer.wire import encode_layer

    reference = tiny_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0].token_ids

    async def main():
        dec = await _worker("decode", tiny_model_dir, CREDS, None)
        pre = await _worker("prefill", tiny_model_dir, CREDS, None)
        try:
            async with rpc.aio_channel(dec.address, CREDS) as dch, \
                    rpc.aio_channel(pre.address, CREDS) as pch:
                d = decode_pb2_grpc.DecodeWorkerStub(dch)
                sp = GREEDY.to_proto()
                res = await d.Reserve(decode_pb2.ReserveRequest(
                    request_id="victim", prompt_token_ids=PROMPT, sampling=sp))
                assert len(res.reservation_secret) == 32  # 128 bits, hex
                before = dec.engine.kv_cache.data.clone()
                k = before[0, 0, :res.num_blocks].clone() + 7
                forged = [kvtransfer_pb2.KVMessage(chunk=c) for c in encode_layer(
                    res.reservation_id, 0, list(range(res.num_blocks)), k, k.clone())]
                kv = kvtransfer_pb2_grpc.KVTransferStub(dch)
                for secret in (None, "", "0" * 32, res.reservation_secret[:-1] + "x"):
                    md = () if secret is None else ((SECRET_METADATA, secret),)

                    async def msgs():
                        for m in forged:
                            yield m
                    assert await _code(kv.Push(msgs(), metadata=md)) == \
                        grpc.StatusCode.PERMISSION_DENIED
                assert dec.engine.kv_cache.data.equal(before), "forged KV reached the cache"
                # the reservation is intact: the real prefill completes it
                stream = d.Decode(decode_pb2.DecodeRequest(reservation_id=res.reservation_id))
                await prefill_pb2_grpc.PrefillWorkerStub(pch).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="victim", prompt_token_ids=PROMPT, sampling=sp,
                        decode_address=dec.address, reservation_id=res.reservation_id,
                        reserved_blocks=res.num_blocks, decode_kv_spec=res.kv_spec,
                        reservation_secret=res.reservation_secret))
                tokens = [t async for ch in stream for t in ch.token_ids]
            for _ in range(50):
                if (await _free(dec))[0] == (await _free(dec))[1]:
                    break
                await asyncio.sleep(0.1)
            assert (await _free(dec))[0] == (await _free(dec))[1]
            return tokens
        finally:
            await dec.stop(0)
            await pre.stop(0)

    assert asyncio.run(main()) == reference


# ---------------------------------------------------------------------------- request ids


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_duplicate_client_request_ids_do_not_interfere(tiny_model_dir, mode):
    """Two clients send the same request_id at once; one leaves after its first tokens.
    The other still gets its whole, correct output, and its own id back."""
    prompt_a = list(range(200, 230))
    prompt_b = list(range(300, 345))
    n = 24
    ref = tiny_engine(tiny_model_dir).generate(
        [prompt_a], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids

    async def main():
        g, workers = await _cluster(tiny_model_dir, n_prefill=1 if mode == "disaggregated"
                                    else 0)
        try:
            async with grpc.aio.insecure_channel(g.grpc_address) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)

                def request(ids: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
                    return gateway_pb2.GenerateRequest(
                        request_id="same", token_ids=gateway_pb2.TokenIds(ids=ids),
                        sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                           temperature=0, ignore_eos=True))

                async def full():
                    out = []
                    async for r in stub.Generate(request(prompt_a, n)):
                        assert r.request_id == "same"  # the client's id comes back
                        out.extend(r.token_ids)
                    return out

                async def leaver():
                    call = stub.Generate(request(prompt_b, 200))
                    async for r in call:
                        if r.token_ids:
                            break
                    call.cancel()  # cancels "same" at the worker: only its own

                got, _ = await asyncio.gather(full(), leaver())
            for w in workers:
                for _ in range(100):
                    free, total = await _free(w)
                    if free == total:
                        break
                    await asyncio.sleep(0.05)
                assert free == total
            return got
        finally:
            await _stop(g, workers)

    assert asyncio.run(main()) == ref


# ---------------------------------------------------------------------------- mTLS


def _pki(tmp: Path) -> dict[str, str]:
    """A CA and a certificate (SAN 127.0.0.1, localhost) signed by it, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name, key, issuer_name, issuer_key, ca: bool):
        b = (x509.CertificateBuilder().subject_name(x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
    ca = cert("pdserve test CA", ca_key, ca_name, ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    member = cert("pdserve member", key, ca_name, ca_key, False)
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM),
             "cert": member.public_bytes(serialization.Encoding.PEM),
             "key": key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())}
    out = {}
    for name, data in files.items():
        (tmp / f"{name}.pem").write_bytes(data)
        out[name] = str(tmp / f"{name}.pem")
    return out


def test_mtls_cluster_serves_and_refuses_clients_without_a_certificate(tiny_model_dir,
                                                                        tmp_path):
    pki = _pki(tmp_path)
    creds = ClusterCredentials(token=TOKEN, tls_cert=pki["cert"], tls_key=pki["key"],
                               tls_ca=pki["ca"])
    ref = tiny_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0].token_ids

    async def main():
        # registration, gateway -> workers and the KV push all over mTLS
        g, workers = await _cluster(tiny_model_dir, creds)
        try:
            assert len(g.registry.alive(Role.DECODE)) == len(g.registry.alive(Role.PREFILL)) == 1
            async with PdserveClient(g.grpc_address) as c:
                out = [t async for ch in c.generate(token_ids=PROMPT, max_tokens=12, temperature=0,
                                                      ignore_eos=True) for t in ch.token_ids]
            assert out == ref
            dec = workers[-1]
            ca_only = grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes())
            for addr in (dec.address, g.registry_address):
                # the token alone does not do: the server wants a client certificate
                async with grpc.aio.secure_channel(addr, ca_only) as ch:
                    code = await _code(decode_pb2_grpc.DecodeWorkerStub(ch).Stats(
                        common_pb2.StatsRequest(), metadata=CREDS.metadata(), timeout=5))
                    assert code == grpc.StatusCode.UNAVAILABLE
                async with grpc.aio.insecure_channel(addr) as ch:  # nor plaintext
                    code = await _code(decode_pb2_grpc.DecodeWorkerStub(ch).Stats(
                        common_pb2.StatsRequest(), metadata=CREDS.metadata(), timeout=5))
                    assert code == grpc.StatusCode.UNAVAILABLE
            async with rpc.aio_channel(dec.address, creds) as ch:
                s = await decode_pb2_grpc.DecodeWorkerStub(ch).Stats(common_pb2.StatsRequest())
                assert s.worker_id == dec.worker_id
        finally:
            await _stop(g, workers)

    asyncio.run(main())


# ---------------------------------------------------------------------------- keepalive


async def _idle_states(server_keepalive: rpc.Keepalive | None, idle_s: float) -> set[str]:
    """States an idle channel (keepalive every 1 s, the least gRPC allows) passes through,
    against a server made by `rpc.server` with `server_keepalive`, or by gRPC's defaults
    (None: what every tier's server was before)."""
    from grpc_health.v1 import health

    ka = rpc.Keepalive(time_s=1.0, timeout_s=2.0)
    srv = (rpc.server(ClusterCredentials(), server_keepalive) if server_keepalive
           else grpc.aio.server())
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    port = rpc.add_port(srv, "127.0.0.1:0", None)
    await srv.start()
    ch = rpc.aio_channel(f"127.0.0.1:{port}", ClusterCredentials(), ka)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        await stub.Check(health_pb2.HealthCheckRequest())
        states = set()
        for _ in range(int(idle_s / 0.05)):
            await asyncio.sleep(0.05)
            states.add(ch.get_state().name)
        await stub.Check(health_pb2.HealthCheckRequest())  # and it still serves
        return states
    finally:
        await ch.close()
        await srv.stop(0)


def test_idle_channels_keep_their_connection():
    """Idle for ~4 keepalive periods: the factories' settings agree, so the connection
    stays READY; against a server with gRPC's default ping policy the same channel gets
    GOAWAY too_many_pings and drops to IDLE (the failure this guards against)."""
    async def main():
        ours = await _idle_states(rpc.Keepalive(time_s=1.0, timeout_s=2.0), 4.5)
        default = await _idle_states(None, 4.5)
        return ours, default

    ours, default = asyncio.run(main())
    assert ours == {"READY"}
    assert default != {"READY"}


def test_a_cluster_channel_reaches_a_restarted_peer_within_a_second():
    """A peer down for 6.5 s (a worker `pdserve up` restarts, its model loading) and then
    back on its address: the tiers' channels (`rpc.aio_channel`) try it again at most a
    second apart, so a call made 1.5 s after it is back gets through. With gRPC's default
    backoff (1 s, 1.6x a try) the tries fall near 1, 2.6, 5.2 and 9.3 s: the channel would
    still be waiting out its backoff then, failing calls as UNAVAILABLE."""
    from grpc_health.v1 import health

    async def main() -> tuple[list[str], str]:
        srv = rpc.server(ClusterCredentials())
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
        port = rpc.add_port(srv, "127.0.0.1:0", None)
        await srv.start()
        await srv.stop(0)  # the port is known and nothing listens on it
        ch = rpc.aio_channel(f"127.0.0.1:{port}", ClusterCredentials())
        stub = health_pb2_grpc.HealthStub(ch)
        down = []
        try:
            for _ in range(13):  # fail-fast calls every 0.5 s while the peer is down
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    down.append("OK")
                except grpc.aio.AioRpcError as e:
                    down.append(e.code().name)
                await asyncio.sleep(0.5)
            back = rpc.server(ClusterCredentials())
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), back)
            rpc.add_port(back, f"127.0.0.1:{port}", None)
            await back.start()
            try:
                await asyncio.sleep(1.5)
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    after = "OK"
                except grpc.aio.AioRpcError as e:
                    after = e.code().name
            finally:
                await back.stop(0)
        finally:
            await ch.close()
        return down, after

    down, after = asyncio.run(main())
    assert set(down) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED"} and down, down
    assert after == "OK"
