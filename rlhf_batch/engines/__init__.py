"""Generation engines: `hf` (our sampler over the transformers model, engines/hf.py) and `vllm`
(engines/vllm.py, in its own venv). Every engine turns prompts into (response_ids,
behavior_logprobs, finish_reason) rows under the same definitions (engines/base.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_batch.config import Config
    from rlhf_batch.data.prompts import Prompts
    from rlhf_batch.engines.base import Engine


def make_engine(cfg: Config, policy: str, tok: Any, prompts: Prompts) -> Engine:
    """The configured generation engine, sampling with `cfg.generate`'s settings (generate and eval)."""
    if cfg.generate.engine == "vllm":
        from rlhf_batch.engines.vllm import VLLMEngine

        return VLLMEngine(cfg, policy, tok, prompts)
    from rlhf_batch.engines.hf import HFEngine

    return HFEngine(cfg, policy, tok, prompts)


def engine_version(engine: str) -> str:
    """The version of the package that samples: vllm, or transformers under the hf sampler."""
    if engine == "vllm":
        from rlhf_batch.engines.vllm import version

        return version()
    import transformers

    return str(transformers.__version__)
