"""A/B of the shm sender (docs/benchmarks.md, section 2). From the repository root:

    PYTHONPATH=. python docs/bench/shm_ab.py ROUNDS TOKENS   (the docs: 5 4096)

Interleaved, in one cluster run: A = main's sender (a fresh
mapping per transfer, faulted in lazily, closed at stream end; CRC-32C a pass of its own over
the tensors), B = this branch's."""

import asyncio
import mmap
import os
import statistics
import sys

from pdserve.bench import kv_transfer as kt
from pdserve.cluster import LocalCluster
from pdserve.cluster_auth import ClusterCredentials
from pdserve.kvtransfer import shm_sender, wire
from pdserve.kvtransfer.shm import ShmSegment
from pdserve.protos.pdserve.v1 import kvtransfer_pb2


def old_descriptors(rid, layer, idx, k, v, segment, *, offset, first_seq=0, max_chunk_bytes=0):
    for header, kb, vb in wire._layer_parts(rid, layer, idx, k, v, first_seq, max_chunk_bytes):
        mid = offset + kb.nbytes
        end = mid + vb.nbytes
        segment[offset:mid] = kb
        segment[mid:end] = vb
        header.shm.offset = offset
        header.shm.length = end - offset
        yield wire.EncodedChunk(
            kvtransfer_pb2.KVMessage(chunk=header).SerializeToString(), end - offset
        )
        offset = end


class OldStream(shm_sender.ShmKVPushStream):
    def _encode(self, item):
        for chunk in old_descriptors(
            self.reservation_id,
            item.layer,
            item.block_indices,
            item.k,
            item.v,
            self._view,
            offset=self._offset,
            first_seq=self._num_chunks,
            max_chunk_bytes=self._max_chunk_bytes,
        ):
            self._offset += chunk.payload_bytes
            yield chunk

    def _requests_done(self):
        self._view.release()
        self.segment.close()


class OldTransport(shm_sender.ShmKVTransport):
    def open(self, dest, rid, spec, secret="", shm=None):
        fd = os.open(self.directory / shm.segment, os.O_RDWR)
        mm = mmap.mmap(fd, shm.size)
        os.close(fd)
        seg = ShmSegment(shm.segment, shm.size, mm, self.directory)
        return OldStream(
            seg,
            self._push_method(dest),
            dest,
            rid,
            spec,
            self.shm_max_chunk_bytes,
            self._timeout_s,
            self._abort_wait_s,
            self._push_metadata(secret),
        )


rounds = int(sys.argv[1])
n_tokens = int(sys.argv[2])
cl = LocalCluster(
    model="smollm2-135m",
    num_prefill=1,
    num_decode=1,
    http_port=0,
    grpc_port=0,
    cpus="auto",
    engine_args=("--kv-cache-memory", "1GiB"),
)
with cl:
    eps = cl.endpoints
    dec = next(w for w in eps.workers if w.tier == "decode")
    pre = next(w for w in eps.workers if w.tier == "prefill")
    kt.pin_this_process(pre.cpus)
    creds = ClusterCredentials(token=cl.cluster_token)
    rates = {"A": [], "B": []}

    async def go():
        from pdserve import rpc
        from pdserve.protos.pdserve.v1 import decode_pb2_grpc

        async with rpc.aio_channel(dec.address, creds) as ch:
            d = decode_pb2_grpc.DecodeWorkerStub(ch)
            ts = {
                "A": OldTransport("shm", credentials=creds),
                "B": shm_sender.ShmKVTransport("shm", credentials=creds),
            }
            cache = {}
            for t in ts.values():
                await kt._push_once(d, dec.address, dec.pid, t, n_tokens, 1, cache)
            for r in range(rounds):
                for name, t in ts.items():
                    p = await kt._push_once(d, dec.address, dec.pid, t, n_tokens, 10 + r, cache)
                    rates[name].append(p.nbytes / p.wall_s / 1e9)
                    print(
                        name,
                        round(rates[name][-1], 3),
                        "GB/s",
                        "send ms/MiB",
                        round(p.sender_cpu_s * 1e3 / (p.nbytes / 2**20), 3),
                        "recv ms/MiB",
                        round(p.receiver_cpu_s * 1e3 / (p.nbytes / 2**20), 3),
                        flush=True,
                    )
            for t in ts.values():
                t.close()

    asyncio.run(go())
    for name, r in rates.items():
        print(name, "median GB/s", round(statistics.median(r), 3), [round(x, 3) for x in r])
