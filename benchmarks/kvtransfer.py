"""KV pull bandwidth between two processes over NIXL, against a plain memory copy.

A producer process holds a KV cache of a realistic shape (32 layers, 8 KV heads, head size
128, block size 16, bfloat16: 2 MiB per block); this process pulls N of its blocks with a
NIXL READ, as a decode pod does. For each size (1, 8, 64, 512 MB of KV; 1 MB rounds up to
one whole block) it measures, interleaved trial by trial:

- copy: one memcpy (`numpy.copyto`, a single thread) of the same bytes (the pulled blocks)
  into a second span of this process's cache: the bound to compare with;
- copy in 16 MiB chunks: the same copy as memcpy calls of 16 MiB. A reference only (the
  ratios stay against the whole copy): glibc's memcpy switches to non-temporal stores above
  `glibc.cpu.x86_non_temporal_threshold` (derived from the L3 size it detects: 181 MiB on
  the 2-core VM that reports a 482 MiB L3; `ld.so --list-tunables` prints it), and those
  stores skip reading the destination into the cache first. The kernel's copy in process_vm_readv never does (it is `rep movsb` with normal
  stores), so above that threshold the whole copy moves a third less memory traffic than
  any single-copy CMA read can, and the chunked copy shows what the same stores cost;
- cma: one `process_vm_readv` of the same bytes from the producer's address space, the
  kernel's single-copy path that UCX's CMA transport uses for a READ on one host: what
  one READ could reach here (the kernel pins each 4 KiB page before copying it). A pull of
  16 MiB or more is split into `--read-threads` READs posted at once (the connector's
  default, see nixl_backend.py), which is how it gets past this;
- pull, cross-layer layout (kvferry's): blocks outermost, the cache registered as one
  region, one descriptor per run of consecutive block ids;
- pull, per-layer layout: one region per layer, one descriptor per layer per run: what a
  layer-major cache would cost;
- connector: the whole path an engine takes (lease renewal on the side channel, READ,
  polling from `get_finished`), with the handshake already cached; signed as a service's
  pods sign (the params' MAC checked on arrival, every side-channel call and reply signed).

Block ids are realistic, not one tidy range: the producer's blocks are runs of 1-16
consecutive ids in shuffled order, the consumer's one range, so descriptors per pull are
the producer's runs. Pulled bytes are checked against the producer's (by digest). Only one
pair of caches exists at a time (freed before the next size): the producer's, and this
process's with room for the pull and for the copy. Both are allocated as the engine should
allocate its cache (`kvtransfer.memory.allocate_kv_cache`: huge pages where the kernel
allows, which a CMA read needs to come near memcpy speed).

Transport: NIXL's UCX backend runs with `ucx_error_handling_mode=none` (the transfer
layer's default, see nixl_backend.py): in "peer" mode UCX rules out its shared-memory
transports, which cannot detect a failed peer, and `--ucx-error-mode peer` shows the cost.

    python benchmarks/kvtransfer.py [--sizes-mb 1 8 64 512] [--trials 5] [--ucx-error-mode none]
                                    [--read-threads N]

The last line is one JSON object; `ratio_64MB` is pull GB/s / copy GB/s at 64 MB.

What the figures showed (2 shared cores): the pull runs at the CMA read's speed at every
size (`pull_vs_cma` about 1.0), so NIXL and the descriptors add nothing measurable; at 64
MB the copy and the read both run out of the L3 cache and the pull is 0.8-1.0 of the copy;
at 512 MB the copy switches to non-temporal stores (about 11-12 GB/s against 6-7 at 64 MB)
while the read cannot, and the pull drops to about 0.5 of it but stays about 1.0 of the
chunked copy. Splitting the READ across NIXL's UCX thread pool (`num_threads`, descriptors
split between threads) made it slower here: the threads only contend for the same two
cores. A read faster than one kernel copy needs a transport that maps the producer's
memory (xpmem, knem) or several cores to spare.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from kvferry.kvtransfer import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
    KVTransferMetrics,
    KVTransferParams,
)
from kvferry.kvtransfer.auth import (
    KEY_ENV,
    SideChannelAuth,
    check_params,
    generate_key_text,
    key_from_environment,
)
from kvferry.kvtransfer.layout import block_runs
from kvferry.kvtransfer.memory import allocate_kv_cache
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlBackend
from kvferry.kvtransfer.side_channel import RENEW_PATH, LeaseRequest

TARGET_RATIO = 0.7
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# Bytes of one layer's keys and values for one block, and of one block across layers.
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize
BLOCK_BYTES = NUM_LAYERS * LAYER_BLOCK_BYTES
MB = 1 << 20
CHUNK_COPY_BYTES = 16 * MB


# ---------------------------------------------------------------------- caches
def cross_layer_view(buf: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size): kvferry's cache."""
    return buf.view(DTYPE).view(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)


def per_layer_views(buf: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """The same bytes as num_layers caches of (num_blocks, 2, block_size, heads, head_size)."""
    layers = buf.view(DTYPE).view(NUM_LAYERS, num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return list(layers.unbind(0))


def fill_random(buf: torch.Tensor, seed: int) -> None:
    """Random bytes in 64 MiB chunks, so filling needs no second buffer of the cache's size."""
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, buf.numel(), 64 * MB):
        chunk = buf[start:start + 64 * MB]
        chunk.copy_(torch.randint(0, 256, chunk.shape, generator=gen, dtype=torch.uint8))


def shuffled_runs(num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Ids 1..num_blocks as runs of 1-16 consecutive ids, the runs in random order."""
    runs, start = [], 1
    while start <= num_blocks:
        length = min(int(rng.integers(1, 17)), num_blocks + 1 - start)
        runs.append(np.arange(start, start + length))
        start += length
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])


# ---------------------------------------------------------------------- producer
@dataclass
class ProducerSide:
    """What the consumer gets from the producer for one size."""

    cross_meta: bytes
    cross_region: Any
    layer_meta: bytes
    layer_regions: list[Any]


def producer_main(conn: Any, ucx_error_mode: str) -> None:
    """Serves one size at a time: caches, raw NIXL agents for both layouts, a connector."""
    torch.set_num_threads(1)
    state: dict[str, Any] = {}
    while True:
        if state:
            # An engine loop polls its connector every step; NIXL progresses on these polls.
            state["worker"].get_finished()
            state["cross"].notifications()
            state["layer"].notifications()
        if not conn.poll(0.005):
            continue
        command, *args = conn.recv()
        if command == "setup":
            state = producer_setup(*args, ucx_error_mode)
            conn.send((state["side"], state["worker"].endpoint))
        elif command == "hold":
            conn.send(producer_hold(state, *args))
        elif command == "digest":
            conn.send(blocks_digest(state["buf"], *args))
        elif command == "teardown":
            producer_teardown(state)
            state = {}
            conn.send("ok")
        else:
            return


def producer_setup(num_blocks: int, seed: int, ucx_error_mode: str) -> dict[str, Any]:
    buf = allocate_kv_cache((num_blocks * BLOCK_BYTES,), torch.uint8)
    fill_random(buf, seed)
    cross = NixlBackend(f"bench-producer-cross-{seed}", ucx_error_mode)
    cross_region = cross.register(cross_layer_view(buf, num_blocks))
    layer = NixlBackend(f"bench-producer-layer-{seed}", ucx_error_mode)
    layer_regions = [layer.register(v) for v in per_layer_views(buf, num_blocks)]
    config = KVTransferConfig(model_id="bench", ucx_error_handling_mode=ucx_error_mode,
                              transfer_key=key_from_environment(os.environ))
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics)
    endpoint = worker.register_kv_caches(cross_layer_view(buf, num_blocks))
    scheduler = KVConnectorScheduler(config, BLOCK_SIZE, endpoint, worker.leases, metrics)
    side = ProducerSide(cross.metadata, cross_region, layer.metadata, layer_regions)
    return {"buf": buf, "side": side, "cross": cross, "layer": layer, "worker": worker,
            "scheduler": scheduler}


def prompt_tokens(num_tokens: int) -> list[int]:
    """The prompt every hold is computed for: the consumer sends the same, so its hash matches."""
    return [0] * num_tokens


def producer_hold(state: dict[str, Any], req_id: str, block_ids: list[int]) -> dict:
    num_tokens = len(block_ids) * BLOCK_SIZE
    keep, params = state["scheduler"].request_finished(
        req_id, KVTransferParams(do_remote_decode=True), [block_ids], prompt_tokens(num_tokens),
        num_tokens, aborted=False,
    )
    assert keep and params is not None
    return params


def blocks_digest(buf: torch.Tensor, block_ids: np.ndarray) -> str:
    """sha256 of the given blocks' bytes, in order."""
    blocks = buf.view(-1, BLOCK_BYTES)
    digest = hashlib.sha256()
    for block_id in block_ids:
        digest.update(blocks[int(block_id)].numpy())
    return digest.hexdigest()


def producer_teardown(state: dict[str, Any]) -> None:
    state["scheduler"].shutdown()
    state["worker"].shutdown()
    state["cross"].close()
    state["layer"].close()
    state.clear()
    gc.collect()


# ---------------------------------------------------------------------- consumer
@dataclass
class Trials:
    copy_s: list[float]
    # The same copy in memcpy calls of CHUNK_COPY_BYTES (normal stores, like the kernel's).
    chunked_copy_s: list[float]
    cma_s: list[float]
    cross_s: list[float]
    layer_s: list[float]
    connector_s: list[float]
    # Of each connector pull, the seconds its READ took (the transfer layer's own metric).
    connector_read_s: list[float]


def timed_read(backend: NixlBackend, remote: str, reads: list[GroupRead]) -> float:
    """Seconds from posting a READ to seeing it done (busy polling, as tight as it gets)."""
    start = time.perf_counter()
    transfer = backend.read(remote, reads, b"")
    while (state := backend.poll(transfer)) == "PROC":
        pass
    elapsed = time.perf_counter() - start
    backend.release(transfer)
    if state != "DONE":
        raise RuntimeError(f"benchmark read ended in {state}")
    return elapsed


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def timed_cma(pid: int, remote_addr: int, dst: np.ndarray) -> float:
    """Seconds of one process_vm_readv of len(dst) bytes at remote_addr in process pid."""
    local = _IoVec(dst.ctypes.data, dst.nbytes)
    remote = _IoVec(remote_addr, dst.nbytes)
    start = time.perf_counter()
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    elapsed = time.perf_counter() - start
    if got != dst.nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {dst.nbytes} bytes")
    return elapsed


def timed_copy(dst: np.ndarray, src: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def timed_chunked_copy(dst: np.ndarray, src: np.ndarray) -> float:
    """The copy as memcpy calls of CHUNK_COPY_BYTES, each below glibc's non-temporal threshold."""
    start = time.perf_counter()
    for offset in range(0, src.nbytes, CHUNK_COPY_BYTES):
        end = offset + CHUNK_COPY_BYTES
        np.copyto(dst[offset:end], src[offset:end])
    return time.perf_counter() - start


def connector_pull(conn: Any, consumer: tuple[KVConnectorWorker, KVConnectorScheduler],
                   req_id: str, remote_ids: np.ndarray, local_ids: np.ndarray
                   ) -> tuple[float, float]:
    """Seconds an engine waits for one pull through the connector (handshake cached), and
    the seconds of its READ alone."""
    worker, scheduler = consumer
    read_s_before = worker.metrics.snapshot().pull_seconds_sum
    conn.send(("hold", f"p-{req_id}", remote_ids.tolist()))
    params = KVTransferParams.from_dict(conn.recv())
    num_tokens = len(local_ids) * BLOCK_SIZE
    start = time.perf_counter()
    scheduler.add_request(req_id, params)
    num_external = scheduler.get_num_new_matched_tokens(params, prompt_tokens(num_tokens + 1), 0)
    scheduler.update_state_after_alloc(req_id, params, [local_ids.tolist()], 0, num_external)
    worker.apply(scheduler.build_connector_meta())
    while True:
        done = scheduler.get_finished(worker.get_finished())
        if req_id in done.ready:
            elapsed = time.perf_counter() - start
            return elapsed, worker.metrics.snapshot().pull_seconds_sum - read_s_before
        if req_id in done.failed:
            raise RuntimeError(f"connector pull failed: {done.failed[req_id]}")
        # An engine loop yields the GIL while its model runs; a bare spin here would hold it
        # and starve the transfer thread (the interpreter switches threads every 5 ms).
        time.sleep(0.0002)


def measure_size(conn: Any, producer_pid: int, size_mb: int, trials: int, ucx_error_mode: str,
                 read_threads: int, rng: np.random.Generator, verbose: bool) -> dict[str, Any]:
    num_pulled = max(1, math.ceil(size_mb * MB / BLOCK_BYTES))
    # Block 0 is the null block on both sides.
    num_blocks = num_pulled + 1
    conn.send(("setup", num_blocks, size_mb))
    side, _ = conn.recv()
    # Blocks [0, num_blocks) receive the pulls, the rest receives the copy.
    cache = allocate_kv_cache(((num_blocks + num_pulled) * BLOCK_BYTES,), torch.uint8)
    cache.fill_(1)  # every page touched: no trial pays for first-touch faults
    dst = cache[:num_blocks * BLOCK_BYTES]
    remote_ids = shuffled_runs(num_pulled, rng)
    local_ids = np.arange(1, num_blocks)
    cross, layer, consumer = consumer_agents(side, dst, num_blocks, ucx_error_mode, read_threads)
    try:
        cross_reads = [GroupRead(cross.region, side.cross_region, BLOCK_BYTES,
                                 block_runs(local_ids, remote_ids))]
        layer_reads = [GroupRead(local, remote, LAYER_BLOCK_BYTES,
                                 block_runs(local_ids, remote_ids))
                       for local, remote in zip(layer.regions, side.layer_regions, strict=True)]
        # The pulled span, and where the copy of it goes.
        pulled_np = cache[BLOCK_BYTES:num_blocks * BLOCK_BYTES].numpy()
        copy_np = cache[num_blocks * BLOCK_BYTES:].numpy()
        # Warm-up: UCX connects on a first transfer; the connector also handshakes.
        timed_read(cross.backend, cross.remote, cross_reads)
        timed_read(layer.backend, layer.remote, layer_reads)
        connector_pull(conn, consumer, f"{size_mb}-warmup", remote_ids, local_ids)
        results = Trials([], [], [], [], [], [], [])
        remote_span = side.cross_region.base_addr + BLOCK_BYTES
        for trial in range(trials):
            results.copy_s.append(timed_copy(copy_np, pulled_np))
            results.chunked_copy_s.append(timed_chunked_copy(copy_np, pulled_np))
            results.cma_s.append(timed_cma(producer_pid, remote_span, pulled_np))
            results.cross_s.append(timed_read(cross.backend, cross.remote, cross_reads))
            results.layer_s.append(timed_read(layer.backend, layer.remote, layer_reads))
            total_s, read_s = connector_pull(conn, consumer, f"{size_mb}-{trial}", remote_ids,
                                             local_ids)
            results.connector_s.append(total_s)
            results.connector_read_s.append(read_s)
        check_pulled(conn, dst, remote_ids, local_ids)
        mac_s = mac_seconds(conn, remote_ids)
        if verbose:
            num_bytes = num_pulled * BLOCK_BYTES
            for name, seconds in vars(results).items():
                print(f"  {name:12} GB/s per trial:",
                      " ".join(f"{num_bytes / s / 1e9:.2f}" for s in seconds))
        descriptors = {"cross": len(cross_reads[0].runs),
                       "layer": sum(len(r.runs) for r in layer_reads)}
        return summarize(size_mb, num_pulled, results, descriptors, mac_s)
    finally:
        consumer[1].shutdown()
        consumer[0].shutdown()
        cross.backend.close()
        layer.backend.close()
        del side, dst, cache
        conn.send(("teardown",))
        conn.recv()
        gc.collect()


@dataclass
class ConsumerAgent:
    backend: NixlBackend
    remote: str
    region: Any = None
    regions: list[Any] | None = None


def consumer_agents(side: ProducerSide, dst: torch.Tensor, num_blocks: int, ucx_error_mode: str,
                    read_threads: int) -> tuple[ConsumerAgent, ConsumerAgent,
                               tuple[KVConnectorWorker, KVConnectorScheduler]]:
    cross_backend = NixlBackend(f"bench-consumer-cross-{num_blocks}", ucx_error_mode,
                                read_threads=read_threads)
    cross = ConsumerAgent(cross_backend, cross_backend.add_remote(side.cross_meta),
                          region=cross_backend.register(cross_layer_view(dst, num_blocks)))
    layer_backend = NixlBackend(f"bench-consumer-layer-{num_blocks}", ucx_error_mode,
                                read_threads=read_threads)
    layer = ConsumerAgent(layer_backend, layer_backend.add_remote(side.layer_meta),
                          regions=[layer_backend.register(v)
                                   for v in per_layer_views(dst, num_blocks)])
    config = KVTransferConfig(model_id="bench", ucx_error_handling_mode=ucx_error_mode,
                              read_threads=read_threads,
                              transfer_key=key_from_environment(os.environ))
    metrics = KVTransferMetrics()
    worker = KVConnectorWorker(config, metrics)
    endpoint = worker.register_kv_caches(cross_layer_view(dst, num_blocks))
    scheduler = KVConnectorScheduler(config, BLOCK_SIZE, endpoint, worker.leases, metrics)
    return cross, layer, (worker, scheduler)


def check_pulled(conn: Any, dst: torch.Tensor, remote_ids: np.ndarray,
                 local_ids: np.ndarray) -> None:
    """The last pull was the connector's (cross-layer): blocks must match the producer's."""
    conn.send(("digest", remote_ids))
    if conn.recv() != blocks_digest(dst, local_ids):
        raise RuntimeError("pulled blocks differ from the producer's")


def mac_seconds(conn: Any, remote_ids: np.ndarray, repeats: int = 200) -> float:
    """What the key costs one pull on the consumer: checking a hold's params (as a decode pod
    does before any network call) plus signing and checking one side-channel renewal and
    its reply. Median seconds over `repeats` rounds, on params the producer really signed."""
    key = key_from_environment(os.environ)
    assert key is not None
    conn.send(("hold", "mac-timing", remote_ids.tolist()))
    params = KVTransferParams.from_dict(conn.recv())
    assert params is not None
    side = SideChannelAuth(key)
    body = msgspec.msgpack.encode(LeaseRequest(agent_name="", req_ids=["mac-timing"],
                                               reader="bench"))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        now = time.time()
        refusal = check_params(params, key, now)
        header, nonce = side.sign_request("POST", RENEW_PATH, body)
        served, why = side.check_request("POST", RENEW_PATH, body, header)
        reply = side.sign_reply(nonce, 200, body)
        assert refusal is None and served == nonce and why is None
        assert side.reply_verifies(nonce, 200, body, reply)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def summarize(size_mb: int, num_blocks: int, t: Trials, descriptors: dict[str, int],
              mac_s: float) -> dict[str, Any]:
    num_bytes = num_blocks * BLOCK_BYTES

    def gbps(seconds: list[float]) -> float:
        return num_bytes / statistics.median(seconds) / 1e9

    copy = gbps(t.copy_s)
    return {
        "size_mb": size_mb, "blocks": num_blocks, "bytes": num_bytes,
        "copy_gbps": round(copy, 3),
        "chunked_copy_gbps": round(gbps(t.chunked_copy_s), 3),
        "cma_gbps": round(gbps(t.cma_s), 3),
        "pull_gbps": round(gbps(t.cross_s), 3),
        "pull_ratio": round(gbps(t.cross_s) / copy, 3),
        "pull_vs_cma": round(gbps(t.cross_s) / gbps(t.cma_s), 3),
        "pull_vs_chunked_copy": round(gbps(t.cross_s) / gbps(t.chunked_copy_s), 3),
        "descriptors": descriptors["cross"],
        "per_layer_gbps": round(gbps(t.layer_s), 3),
        "per_layer_ratio": round(gbps(t.layer_s) / copy, 3),
        "per_layer_descriptors": descriptors["layer"],
        "connector_ms": round(statistics.median(t.connector_s) * 1e3, 3),
        "connector_gbps": round(gbps(t.connector_s), 3),
        "connector_read_gbps": round(gbps(t.connector_read_s), 3),
        "mac_us": round(mac_s * 1e6, 2),
        "mac_share_of_connector": round(mac_s / statistics.median(t.connector_s), 6),
    }


def print_row(r: dict[str, Any]) -> None:
    print(f"{r['size_mb']:>5} MB {r['blocks']:>4} blocks | copy {r['copy_gbps']:6.2f} GB/s | "
          f"chunked copy {r['chunked_copy_gbps']:6.2f} GB/s | cma {r['cma_gbps']:6.2f} GB/s | "
          f"pull {r['pull_gbps']:6.2f} GB/s ({r['pull_ratio']:.2f} of copy, "
          f"{r['pull_vs_cma']:.2f} of cma, {r['pull_vs_chunked_copy']:.2f} of chunked copy, "
          f"{r['descriptors']} descs) | per-layer {r['per_layer_gbps']:6.2f} GB/s "
          f"({r['per_layer_ratio']:.2f}, {r['per_layer_descriptors']} descs) | "
          f"connector {r['connector_ms']:.2f} ms ({r['connector_gbps']:.2f} GB/s, its read "
          f"{r['connector_read_gbps']:.2f} GB/s) | MAC checks {r['mac_us']:.1f} us "
          f"({100 * r['mac_share_of_connector']:.3f}% of the pull)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--ucx-error-mode", choices=["none", "peer"], default="none")
    parser.add_argument("--read-threads", type=int, default=KVTransferConfig().read_threads,
                        help="READs a large pull is split into (default: the connector's)")
    parser.add_argument("--verbose", action="store_true", help="print every trial")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The key producer and consumer share, as a service's pods do (the producer inherits it).
    os.environ[KEY_ENV] = generate_key_text()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    producer = ctx.Process(target=producer_main, args=(child_conn, args.ucx_error_mode),
                           daemon=True)
    producer.start()
    rng = np.random.default_rng(0)
    print(f"block {BLOCK_BYTES / MB:.0f} MiB ({NUM_LAYERS} layers x {NUM_KV_HEADS} KV heads x "
          f"{HEAD_SIZE} x block size {BLOCK_SIZE}, {str(DTYPE).removeprefix('torch.')}); "
          f"ucx_error_handling_mode={args.ucx_error_mode}; {args.read_threads} read thread(s); "
          f"median of {args.trials} trials")
    rows = []
    try:
        for size_mb in args.sizes_mb:
            rows.append(measure_size(conn, producer.pid, size_mb, args.trials,
                                     args.ucx_error_mode, args.read_threads, rng,
                                     args.verbose))
            print_row(rows[-1])
    finally:
        conn.send(("exit",))
        producer.join(timeout=30)
        if producer.is_alive():
            producer.kill()
    figures: dict[str, Any] = {f"ratio_{r['size_mb']}MB": r["pull_ratio"] for r in rows}
    figures.update(target_ratio=TARGET_RATIO, ucx_error_handling_mode=args.ucx_error_mode,
                   read_threads=args.read_threads, sizes=rows)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
