"""FlashMLA's dense decode as a peer of verifyd's kernel (build.py makes the module): the
stack's own attention in the in-process benchmark, and a row beside verifyd-bench's.

    peer = FlashMLADense.load("/path/flashmla_dense.so")
    call = peer.call(q, kv_pool, block_table, seqlens, sm_scale)   # q: [B, T, H, 576] bf16
    out, lse = call()          # out [B, T, H, 512] bf16, lse [B, H, T] f32; causal, page 64

The first call of a `call` fills FlashMLA's scheduler metadata (one small kernel); later calls
reuse it and launch the split kernel and the combine only, as a serving stack does once the
metadata is planned for a step. Make the first call outside a timing and outside a capture.
"""

import importlib.machinery
import importlib.util


class FlashMLADense:
    def __init__(self, module):
        self.module = module

    @classmethod
    def load(cls, path):
        loader = importlib.machinery.ExtensionFileLoader("flashmla_dense", path)
        spec = importlib.util.spec_from_loader("flashmla_dense", loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return cls(module)

    def call(self, q, kv_pool, block_table, seqlens, sm_scale, causal=True):
        """A callable of one attention over fixed tensors (their contents may change between
        calls, the metadata's lengths may not). kv_pool: [pages, 64, 576] or [pages, 64, 1,
        576] bf16; block_table [B, max_pages] and seqlens [B] int32."""
        kcache = kv_pool if kv_pool.dim() == 4 else kv_pool.unsqueeze(2)
        meta = {"tiles": None, "splits": None}
        fwd = self.module.dense_decode_fwd

        def run():
            out, lse, meta["tiles"], meta["splits"] = fwd(
                q, kcache, 512, seqlens, block_table, float(sm_scale), causal, meta["tiles"],
                meta["splits"])
            return out, lse
        return run
