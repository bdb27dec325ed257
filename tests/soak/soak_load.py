#!/usr/bin/env python3
"""Load for the soak: STREAMS bidirectional streams and UNARY unary callers against one verifyd,
each sending tiny valid bundles back to back for SECONDS; one message in BAD_EVERY is a bundle
with a bad sm_scale (INVALID_ARGUMENT expected) and, on the streams, one in BAD_EVERY is bytes
that do not parse (INVALID_ARGUMENT in band). Prints one JSON line of counts per status code.

    soak_load.py TARGET SECONDS STREAMS UNARY BAD_EVERY
The generated stubs must be importable (verifyd/v1/*_pb2.py on PYTHONPATH).
"""

import collections
import json
import queue
import struct
import sys
import threading
import time

import grpc
from verifyd.v1 import types_pb2, verify_pb2

D = 576


def tiny_request(request_id, sm_scale=0.0417):
    """B=1, T=2, H=1, a 14-token prefix in one 16-token page, causal mask."""
    draft, kv_len, page = 2, 16, 16
    req = verify_pb2.VerifyRequest(request_id=request_id, sm_scale=sm_scale,
                                   mask_format=verify_pb2.MASK_FORMAT_BYTES)

    def put(t, dtype, shape, data):
        t.dtype = dtype
        t.shape.extend(shape)
        t.raw_contents = data

    bf16 = struct.pack("<H", 0x3F80)  # 1.0
    put(req.q, types_pb2.DTYPE_BF16, [draft, 1, D], bf16 * (draft * D))
    put(req.kv_pool, types_pb2.DTYPE_BF16, [1, page, D], bf16 * (page * D))
    put(req.kv_indptr, types_pb2.DTYPE_I32, [2], struct.pack("<2i", 0, 1))
    put(req.kv_indices, types_pb2.DTYPE_I32, [1], struct.pack("<i", 0))
    put(req.kv_lens, types_pb2.DTYPE_I32, [1], struct.pack("<i", kv_len))
    put(req.tree_mask, types_pb2.DTYPE_U8, [1, draft, draft], bytes([1, 0, 1, 1]))
    return req.SerializeToString()


GOOD = tiny_request("soak")
BAD_BUNDLE = tiny_request("soak-bad", sm_scale=-1.0)
UNPARSEABLE = b"\xff\xff\xff\xff"
identity = lambda b: b  # noqa: E731 - messages travel as bytes


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.codes = collections.Counter()
        self.unexpected = collections.Counter()

    def add(self, code, expected):
        with self.lock:
            self.codes[code] += 1
            if code != expected:
                self.unexpected[f"{code} (expected {expected})"] += 1


def code_name(value):
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c.name
    return str(value)


def message(i, bad_every, unparseable_too):
    if bad_every and i % bad_every == bad_every - 1:
        if unparseable_too and (i // bad_every) % 2:
            return UNPARSEABLE, "INVALID_ARGUMENT"
        return BAD_BUNDLE, "INVALID_ARGUMENT"
    return GOOD, "OK"


def stream_worker(channel, deadline, bad_every, tally):
    call = channel.stream_stream("/verifyd.v1.VerifyService/VerifyStream",
                                 request_serializer=identity, response_deserializer=identity)
    outbox = queue.Queue()
    responses = call(iter(outbox.get, None))
    i = 0
    try:
        while time.monotonic() < deadline:
            msg, expected = message(i, bad_every, True)
            outbox.put(msg)
            resp = verify_pb2.VerifyResponse.FromString(next(responses))
            tally.add(code_name(resp.error_code), expected)
            i += 1
        outbox.put(None)
        for _ in responses:
            tally.add("EXTRA_RESPONSE", "none")
    except grpc.RpcError as e:
        tally.add(f"STREAM_{e.code().name}", "none")


def unary_worker(channel, deadline, bad_every, tally):
    call = channel.unary_unary("/verifyd.v1.VerifyService/Verify",
                               request_serializer=identity, response_deserializer=identity)
    i = 0
    while time.monotonic() < deadline:
        msg, expected = message(i, bad_every, True)
        try:
            call(msg, timeout=30)
            tally.add("OK", expected)
        except grpc.RpcError as e:
            tally.add(e.code().name, expected)
        i += 1


def main():
    target, seconds, streams, unary, bad_every = sys.argv[1:6]
    seconds, streams, unary, bad_every = float(seconds), int(streams), int(unary), int(bad_every)
    channel = grpc.insecure_channel(target)
    grpc.channel_ready_future(channel).result(timeout=30)
    tally = Tally()
    start = time.monotonic()
    deadline = start + seconds
    threads = [threading.Thread(target=stream_worker, args=(channel, deadline, bad_every, tally))
               for _ in range(streams)]
    threads += [threading.Thread(target=unary_worker, args=(channel, deadline, bad_every, tally))
                for _ in range(unary)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    calls = sum(tally.codes.values())
    print(json.dumps({"seconds": round(elapsed, 1), "calls": calls,
                      "calls_per_s": round(calls / elapsed, 1), "codes": dict(tally.codes),
                      "unexpected": dict(tally.unexpected)}))
    return 1 if tally.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
