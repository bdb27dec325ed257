"""One call's answer (VerifyResult) and what every transport does with a VerifyResponse."""

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ._proto import types_pb2


def _path_name(p):
    return types_pb2.PathKind.Name(p)[len("PATH_"):].lower()


def _mode_name(m):
    return types_pb2.Mode.Name(m)[len("MODE_"):].lower()


def _comparison(c):
    return {"test": _path_name(c.test), "ref": _path_name(c.ref), "rel_l2": c.rel_l2,
            "max_abs": c.max_abs, "nmse": c.nmse, "beyond_tol": c.beyond_tol,
            "nan_test": c.nan_test, "inf_test": c.inf_test, "nan_ref": c.nan_ref,
            "inf_ref": c.inf_ref, "lse_max_abs": c.lse_max_abs, "match": c.match,
            "reason": c.reason, "count": c.count}


@dataclass
class VerifyResult:
    """One call's answer.

    o: bf16 [B*T, H, 512], as uint16 bit patterns (numpy) or a torch.bfloat16 tensor on q's
    device when q was a torch tensor. lse: float32 [B*T, H] when asked for, else None.
    """
    o: Any
    lse: Any
    served_path: str                      # "reference" or "custom"
    mode: str                             # "reference", "shadow", "canary" or "custom"
    comparison: Optional[dict]            # with compare_sync, when the call was compared
    timing: dict = field(default_factory=dict)  # server seconds per stage
    request_id: str = ""


def make_result(resp, o, lse):
    t = resp.timing
    return VerifyResult(
        o=o, lse=lse, served_path=_path_name(resp.served_path), mode=_mode_name(resp.mode),
        comparison=_comparison(resp.comparison) if resp.HasField("comparison") else None,
        timing={"decode": t.decode_seconds, "prepare": t.prepare_seconds,
                "served": t.served_seconds, "fetch": t.fetch_seconds, "total": t.total_seconds},
        request_id=resp.request_id)


def inline_outputs(resp):
    """o (uint16) and lse (float32, or None) from the response's bytes."""
    o = np.frombuffer(resp.o.raw_contents, dtype="<u2").reshape(tuple(resp.o.shape))
    lse = None
    if resp.HasField("lse"):
        lse = np.frombuffer(resp.lse.raw_contents, dtype="<f4").reshape(tuple(resp.lse.shape))
    return o, lse


def to_torch(o, lse, device):
    """Host outputs as torch tensors on ``device`` (o as bfloat16)."""
    import torch  # noqa: PLC0415 - present whenever q was a tensor

    o = torch.from_numpy(np.ascontiguousarray(o).view(np.int16).copy()).view(torch.bfloat16)
    o = o.to(device)
    if lse is not None:
        lse = torch.from_numpy(np.array(lse, dtype=np.float32)).to(device)
    return o, lse
