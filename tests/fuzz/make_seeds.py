#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/.

    PYTHONPATH=<dir with the generated verifyd/v1/*_pb2.py> tests/fuzz/make_seeds.py

The seeds are small valid inputs (and a few near misses) for each target; libFuzzer mutates them.
"""

import json
import os
import struct
import sys

from verifyd.v1 import types_pb2, verify_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
D = 576


def bf16(n, seed):
    # Small bf16 values (sign, exponent around 1), deterministic.
    out = bytearray()
    x = seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out += struct.pack("<H", 0x3F00 | (x & 0x7F) | ((x >> 8) & 1) << 15)
    return bytes(out)


def i32(vals):
    return struct.pack(f"<{len(vals)}i", *vals)


def bundle(batch, draft, prefix, page_size, bits, seed):
    """The tensors of a small valid bundle: name -> (dtype, shape, bytes)."""
    kv_len = prefix + draft
    pages = (kv_len + page_size - 1) // page_size
    indptr = [b * pages for b in range(batch + 1)]
    indices = list(range(batch * pages))
    rows = []
    for _ in range(batch):
        for i in range(draft):
            if bits:
                row = bytearray((draft + 7) // 8)
                for j in range(i + 1):
                    row[j >> 3] |= 1 << (j & 7)
            else:
                row = bytearray(1 if j <= i else 0 for j in range(draft))
            rows.append(bytes(row))
    row_bytes = (draft + 7) // 8 if bits else draft
    return {
        "q": ("BF16", [batch * draft, 1, D], bf16(batch * draft * D, seed)),
        "kv_pool": ("BF16", [batch * pages, page_size, D],
                    bf16(batch * pages * page_size * D, seed + 1)),
        "kv_indptr": ("I32", [batch + 1], i32(indptr)),
        "kv_indices": ("I32", [len(indices)], i32(indices)),
        "kv_lens": ("I32", [batch], i32([kv_len] * batch)),
        "tree_mask": ("U8", [batch, draft, row_bytes], b"".join(rows)),
    }


def request(tensors, bits, sm_scale=0.0417):
    dt = {"BF16": types_pb2.DTYPE_BF16, "I32": types_pb2.DTYPE_I32, "U8": types_pb2.DTYPE_U8}
    req = verify_pb2.VerifyRequest(request_id="seed", sm_scale=sm_scale,
                                   mask_format=verify_pb2.MASK_FORMAT_BITS if bits
                                   else verify_pb2.MASK_FORMAT_BYTES)
    for name, (dtype, shape, data) in tensors.items():
        t = getattr(req, name)
        t.dtype = dt[dtype]
        t.shape.extend(shape)
        t.raw_contents = data
    return req.SerializeToString()


def shm_request(tensors, region="r"):
    """q, kv_pool and o_out as ranges of the fuzz target's registered shm region (zeros there),
    the index tensors and the mask inline: the common case of the shm transport."""
    req = verify_pb2.VerifyRequest()
    req.ParseFromString(request(tensors, False))
    rows = tensors["q"][1][0]
    req.o_out.dtype = types_pb2.DTYPE_BF16
    req.o_out.shape.extend([rows, 1, 512])
    offset = 0
    for name, size in (("q", len(tensors["q"][2])), ("kv_pool", len(tensors["kv_pool"][2])),
                       ("o_out", rows * 1024)):
        t = getattr(req, name)
        t.shm.region = region
        t.shm.offset = offset
        t.shm.byte_size = size
        offset += (size + 63) // 64 * 64
    return req.SerializeToString()


def safetensors(tensors, sm_scale=0.0417):
    tensors = dict(tensors)
    tensors["sm_scale"] = ("F32", [1], struct.pack("<f", sm_scale))
    header, offset, body = {"__metadata__": {"source": "seed"}}, 0, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        body += data
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + body


def channel_frame(req, claimed=None):
    # A call channel's shared memory as a client leaves it (src/channel/channel_layout.h): the
    # header page (magic, version, capacity; request_seq at 64, request_bytes at 68) and the
    # request at 4096.
    header = bytearray(4096)
    struct.pack_into("<QII", header, 0, 0x314E484344594656, 1, 4096)
    struct.pack_into("<II", header, 64, 1, len(req) if claimed is None else claimed)
    return bytes(header) + req


def doorbell_input(word, batch, indptr, lens, max_batch=3, slot_bytes=64):
    # The doorbell word, then the request area: layout slot 0 (src/channel/doorbell_layout.h).
    words = [batch, 0] + indptr + [0] * (max_batch + 1 - len(indptr)) + lens + \
        [0] * (max_batch - len(lens))
    area = struct.pack(f"<{len(words)}i", *words)
    return struct.pack("<I", word) + area + bytes(slot_bytes - len(area))


def tap_record(call, batch, pages, flags, indptr, lens, max_batch=3, draft=4, record_bytes=128,
               kv_scale=1.0):
    # One tap slot's record (kernels/tap/tap_abi.h): call, batch, pages, flags, kv_scale's bits,
    # kv_indptr, kv_lens, then the tree mask's bytes.
    scale_bits = struct.unpack("<i", struct.pack("<f", kv_scale))[0]
    words = [call, batch, pages, flags, scale_bits] + indptr + \
        [0] * (max_batch + 1 - len(indptr)) + lens + [0] * (max_batch - len(lens))
    head = struct.pack(f"<{len(words)}i", *words)
    mask = bytes(1 if j <= i else 0 for _ in range(max_batch) for i in range(draft)
                 for j in range(draft))
    return (head + mask + bytes(record_bytes))[:record_bytes]


def vmm_fds_input(fds, token, first, total, magic=b"VMFD"):
    # How many descriptors came with the message, then its payload (src/transport/vmm_fd_payload.h).
    return bytes([fds]) + magic + token + struct.pack("<II", first, total)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def main():
    small = bundle(batch=1, draft=1, prefix=1, page_size=1, bits=False, seed=1)
    tree = bundle(batch=2, draft=2, prefix=0, page_size=1, bits=False, seed=2)
    bits = bundle(batch=1, draft=2, prefix=0, page_size=1, bits=True, seed=3)
    write("request", "small", request(small, False))
    write("request", "tree", request(tree, False))
    write("request", "bits", request(bits, True))
    write("request", "bad_sm_scale", request(small, False, sm_scale=-1))
    write("request", "shm_region", shm_request(tree))
    write("channel", "small", channel_frame(request(small, False)))
    write("channel", "shm_region", channel_frame(shm_request(tree)))
    write("channel", "bad_claims_too_much", channel_frame(request(small, False), claimed=1 << 30))
    write("doorbell", "good", doorbell_input(0x80000000, 2, [0, 3, 9], [40, 90]))
    write("doorbell", "descriptor_1", doorbell_input(0x80000001, 1, [0, 40], [600]))
    write("doorbell", "bad_batch", doorbell_input(0x80000000, 9, [0, 1], [4]))
    write("tap", "good", tap_record(7, 2, 9, 0, [0, 3, 9], [40, 90]))
    write("tap", "good_e4m3_scale", tap_record(10, 2, 9, 0, [0, 3, 9], [40, 90], kv_scale=0.37))
    write("tap", "bad_malformed", tap_record(8, 2, 9, 1, [0, 3, 9], [40, 90]))
    write("tap", "bad_pages", tap_record(9, 1, 41, 0, [0, 41], [600]))
    token = bytes(range(1, 17))
    write("vmm_fds", "one_message", vmm_fds_input(13, token, 0, 13))
    write("vmm_fds", "second_message", vmm_fds_input(253, token, 253, 600))
    write("vmm_fds", "bad_no_fds", vmm_fds_input(0, token, 0, 1))
    write("vmm_fds", "bad_first", vmm_fds_input(4, token, 10, 12))
    write("vmm_fds", "bad_magic", vmm_fds_input(1, token, 0, 1, magic=b"VMFX"))
    write("safetensors", "small", safetensors(small))
    write("safetensors", "tree", safetensors(tree))
    write("safetensors", "bad_header_only", struct.pack("<Q", 2) + b"{}")
    write("state", "shadow", '{"mode":"shadow","canary_fraction":0.05,'
          '"shadow_sample_rate":1.0,"custom_sample_rate":0.01}\n')
    write("state", "canary", '{"mode":"canary","canary_fraction":0.25,"shadow_sample_rate":0.5,'
          '"custom_sample_rate":0.1,"custom_faulted":false}\n')
    write("state", "faulted", '{"mode":"shadow","custom_faulted":true,'
          '"custom_fault_reason":"sticky CUDA error"}\n')
    write("audit", "two_lines",
          '{"time":"2026-01-01T00:00:00Z","from":"shadow","to":"canary","canary_fraction":0.05,'
          '"reason":"gate","forced":false,"who":"verifyctl"}\n'
          '{"time":"2026-01-01T00:01:00Z","from":"canary","to":"shadow","canary_fraction":0,'
          '"reason":"rollback","forced":false,"who":"verifyd"}\n')
    write("audit", "bad_torn", '\n{"time":"2026-01-01T00:00:00Z","from":"shadow"')
    write("desired_state", "canary_step",
          '{"generation":7,"mode":"canary","canary_fraction":0.1,"build":"0123456789ab",'
          '"step":{"fraction":0.25},"stable_mode":"shadow","reason":"r3 step 2"}')
    write("desired_state", "custom_nodes",
          '{"generation":2,"mode":"custom","step":{"nodes":["node-a","node-b"]}}')
    write("desired_state", "bad_torn", '{"generation":4,"mode":"sha')
    write("rollout_plan", "custom_three_steps",
          '{"name":"r7","mode":"custom","build":"0123456789ab","stable_mode":"shadow",'
          '"steps":[0.125,0.25,1.0],"step_duration_s":300,"analysis_interval_s":30,'
          '"settle_timeout_s":120,"prometheus":"http://prometheus:9090","queries":['
          '{"name":"breach_rate","query":"sum(rate(verifyd_comparisons_total[5m]))","max":0.001},'
          '{"name":"up","query":"count(up)","min":1}]}')
    write("rollout_plan", "canary",
          '{"name":"c","mode":"canary","canary_fraction":0.05,"steps":[1],"step_duration_s":1,'
          '"analysis_interval_s":0.5,"queries":[{"name":"a","query":"vector(0)","min":0,"max":0}]}')
    write("rollout_plan", "bad_steps",
          '{"name":"r","mode":"custom","steps":[0.5,0.25],"step_duration_s":1}')


if __name__ == "__main__":
    sys.exit(main())
