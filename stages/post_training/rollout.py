"""A rollout worker: generates groups of completions from a versioned policy.

The same class is a Ray actor (``run-<id>-rollout-<n>``) or an in-process worker.
It holds a policy version; weights arrive with their version through
``set_weights``, from Ray's object store or over the collective path's authenticated
socket (stages.post_training.weight_sync). Admission is checked here as well as in
the controller (AReaL): a rollout that would be trained more than ``max_staleness``
versions after the policy it is generated with is refused before any token is
generated, and a worker with no synced weights (a fresh or restarted one) refuses
everything.

The one engine is HF ``generate`` (on CPU, or the worker's GPU on cuda); another
engine would plug in behind ``generate_group`` with the same inputs and outputs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stages.post_training.config import RLVRConfig
    from stages.post_training.weight_descriptors import SentWeights, StateDict
    from stages.post_training.weight_sync import CollectiveReceiver


class PromptEncoding(BaseModel):
    """The RLVR rows' prompts as token ids (the chat template's generation prompt), and
    the tokenizer's pad id: made where the tokenizer is loaded, never in the driver."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ids: list[list[int]]
    pad_id: int


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]]
) -> PromptEncoding:
    return PromptEncoding(
        ids=[prompt_ids(tokenizer, r["prompt"]) for r in rows], pad_id=int(tokenizer.pad_token_id)
    )


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: int
    prompt_ids: list[int]
    answer: str
    group_size: int
    seed: int
    # The trainer version at which this group is expected to be trained.
    consume_step: int
    max_staleness: int
    max_new_tokens: int
    temperature: float = 1.0


class RolloutGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int
    version: int
    worker: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    behav_logp: list[list[float]]
    lengths: list[int]
    truncated: list[bool]
    rewards: list[float]
    task_rewards: list[float]
    gen_s: float


class Refusal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int
    worker: int
    version: int
    reason: str
    gen_s: float = 0.0


class SyncAck(TypedDict):
    """A worker's reply to ``set_weights``: the version it now holds and the seconds the
    fetch and load took; a version it could not get is ``missed`` (with why)."""

    version: int
    load_s: float
    missed: NotRequired[int]
    error: NotRequired[str]


# What a worker answers a call in flight with: a rollout's group or refusal, or a sync's
# acknowledgement.
WorkerReply = RolloutGroup | Refusal | SyncAck


class WorkerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int
    model_dir: str
    reward: str
    max_completion_tokens: int
    overlong_buffer_tokens: int
    overlong_penalty_factor: float
    # How long a worker waits to fetch a version from Ray's object store.
    fetch_timeout_s: float = 300.0
    # Where it generates: cuda is the GPU Ray gave the worker's actor (cuda:0 in it).
    device: Literal["cpu", "cuda"] = "cpu"

    @classmethod
    def for_recipe(
        cls, cfg: RLVRConfig, index: int, model_dir: str, device: Literal["cpu", "cuda"] = "cpu"
    ) -> WorkerSpec:
        """Worker ``index`` of an RLVR recipe (``RLVRConfig``) on ``model_dir``."""
        return cls(
            index=index,
            model_dir=model_dir,
            device=device,
            reward=cfg.reward,
            max_completion_tokens=cfg.max_completion_tokens,
            overlong_buffer_tokens=cfg.overlong_buffer_tokens,
            overlong_penalty_factor=cfg.overlong_penalty_factor,
            fetch_timeout_s=cfg.weight_sync_timeout_s,
        )


def rollout_name(run_id: str, n: int) -> str:
    return f"run-{run_id}-rollout-{n}"


def rollout_prefix(run_id: str) -> str:
    return f"run-{run_id}-rollout-"


def admission_refusal(version: int, req: RolloutRequest, worker: int) -> Refusal | None:
    """The worker's own admission check (AReaL): None if it may start ``req``."""
    if version < 0:
        return Refusal(id=req.id, worker=worker, version=version, reason="no weights")
    if req.consume_step - version > req.max_staleness:
        return Refusal(id=req.id, worker=worker, version=version, reason="stale")
    return None


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, sync_key: bytes | None = None):
        """``sync_key``: the run's weight-sync key (``RunSecret.derive``), handed over
        as an actor argument; the collective path needs it (never logged or kept
        anywhere else)."""
        from stages.post_training.hf_io import load_tokenizer, model_dir
        from stages.post_training.rewards import get_reward

        self.spec = spec
        path = model_dir(spec.model_dir)
        # The tokenizer first, so the driver's prompt encoding is answered as soon as
        # the process is up; the model (torch and transformers' model side: most of the
        # start-up) loads in a thread meanwhile, and what needs it waits for it.
        self.tokenizer = load_tokenizer(path)
        self._model: Any = None
        self._model_error: BaseException | None = None
        self._loading = threading.Thread(
            target=self._load_model, args=(path,), name="model-load", daemon=True
        )
        self._loading.start()
        self.reward_fn = get_reward(spec.reward)
        self.version = -1  # no weights synced yet: refuse every rollout
        # The collective path's end, joined on first use.
        self._receiver: CollectiveReceiver | None = None
        self._sync_key = sync_key
        self.started = time.time()

    def _load_model(self, path: Any) -> None:
        try:
            import torch

            from stages.post_training.hf_io import load_model

            torch.set_num_threads(1)
            # eval mode: transformers' (unannotated) eval() is this call
            self._model = load_model(path).train(False).to(self.spec.device)
        except BaseException as e:  # raised where the model is first needed
            self._model_error = e

    @property
    def model(self) -> Any:
        self._loading.join()
        if self._model_error is not None:
            raise self._model_error
        return self._model

    # -- control ---------------------------------------------------------------------
    def set_weights(self, version: int, weights: SentWeights | None) -> SyncAck:
        """``weights``: a descriptor (``stages.post_training.weight_sync``): an object
        in Ray's object store, fetched here; a collective path's frame, received here; or
        the base folder, loaded here; or a state dict (an in-process learner's copy).
        ``load_s`` covers the fetch or transfer and the load. A version that cannot be
        fetched (its owner died) or received leaves the worker at the one it has: the
        reply's ``version`` is the worker's, ``missed`` the version it did not get."""
        from stages.post_training.weight_descriptors import (
            BaseWeights,
            CollectiveWeights,
            ObjectStoreWeights,
        )
        from stages.post_training.weight_sync import CollectiveReceiver

        t0 = time.perf_counter()
        model = self.model  # the load under way first
        state: StateDict | None = None
        try:
            if isinstance(weights, ObjectStoreWeights):
                import ray

                state = ray.get(weights.ref, timeout=self.spec.fetch_timeout_s)
            elif isinstance(weights, CollectiveWeights):
                if self._receiver is None:
                    if self._sync_key is None:
                        raise ConnectionError("no weight-sync key was given to this worker")
                    self._receiver = CollectiveReceiver(self.spec.index + 1, self._sync_key)
                state = self._receiver.receive(weights)
        except _missed_errors() as e:
            if self._receiver is not None:
                self._receiver.leave()
            return {
                "version": self.version,
                "missed": version,
                "load_s": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {e}"[:200],
            }
        if isinstance(weights, BaseWeights):
            state = self._base_state(weights.model_dir)
        elif isinstance(weights, dict):
            state = weights  # an in-process learner's copy
        if state is not None:
            model.load_state_dict(state)
        self.version = version
        return {"version": version, "load_s": time.perf_counter() - t0}

    def _base_state(self, folder: str) -> StateDict | None:
        """The base folder's weights; None when this worker's model was just built
        from that folder and never changed (nothing to load)."""
        from stages.post_training.hf_io import load_model, model_dir

        if self.version < 0 and folder == self.spec.model_dir:
            return None
        return dict(load_model(model_dir(folder)).state_dict())

    def weights_digest(self) -> str:
        """sha256 of the loaded weights (stages.post_training.weight_sync.state_digest)."""
        from stages.post_training.weight_descriptors import state_digest

        return state_digest(dict(self.model.state_dict()))

    def started_at(self) -> float:
        """When this worker's process was up (its model may still be loading)."""
        return self.started

    def identity(self) -> dict[str, int]:
        """Who the worker is, once it is up with its model loaded."""
        _ = self.model  # raises what the load raised
        return {"pid": os.getpid(), "index": self.spec.index, "version": self.version}

    def encode_prompts(self, rows: list[dict[str, Any]]) -> PromptEncoding:
        """The rows' prompts with this worker's tokenizer (the run's), for the driver's
        request maker: the driver loads no tokenizer."""
        return encode_prompts(self.tokenizer, rows)

    # -- rollouts --------------------------------------------------------------------
    def generate(self, req: RolloutRequest) -> RolloutGroup | Refusal:
        refused = admission_refusal(self.version, req, self.spec.index)
        if refused is not None:
            return refused
        return self.rollout(req)

    def rollout(self, req: RolloutRequest) -> RolloutGroup:
        """Generate and score one group with the current weights (admission checked)."""
        t0 = time.perf_counter()
        out = generate_group(self.model, self.tokenizer, req)
        from stages.post_training.losses import overlong_penalty

        task = [self.reward_fn(text, req.answer) for text in out["texts"]]
        shaped = [
            r
            + overlong_penalty(
                n,
                max_tokens=self.spec.max_completion_tokens,
                buffer_tokens=self.spec.overlong_buffer_tokens,
                factor=self.spec.overlong_penalty_factor,
            )
            for r, n in zip(task, out["lengths"], strict=True)
        ]
        return RolloutGroup(
            id=req.id,
            version=self.version,
            worker=self.spec.index,
            prompt_ids=req.prompt_ids,
            completion_ids=out["completion_ids"],
            behav_logp=out["logp"],
            lengths=out["lengths"],
            truncated=out["truncated"],
            rewards=shaped,
            task_rewards=task,
            gen_s=time.perf_counter() - t0,
        )


def _missed_errors() -> tuple[type[BaseException], ...]:
    """Why a version may not arrive: its object is gone (the owner died) or not
    fetched in time (Ray raises some of those as RuntimeError); the collective sender is
    dead, hung, or not the run's (its connection closed or refused, ``PeerRefused``
    included, or a timeout)."""
    from ray.exceptions import GetTimeoutError, ObjectLostError

    return (ObjectLostError, GetTimeoutError, RuntimeError, ConnectionError, TimeoutError)


def generate_group(model: Any, tokenizer: Any, req: RolloutRequest) -> dict[str, Any]:
    """HF generate: ``group_size`` samples of one prompt, with their behaviour log-probs."""
    import torch

    from stages.post_training.losses import token_logprobs

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = torch.tensor([req.prompt_ids] * req.group_size, dtype=torch.long, device=model.device)
    torch.manual_seed(req.seed)  # every device's generator
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=req.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=req.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
    comp = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, dim=1)
    logp = token_logprobs(logits, comp, req.temperature)
    completion_ids, lps, lengths, truncated, texts = [], [], [], [], []
    for row, lp in zip(comp.tolist(), logp.tolist(), strict=True):
        n = row.index(eos) + 1 if eos in row else len(row)
        completion_ids.append(row[:n])
        lps.append(lp[:n])
        lengths.append(n)
        truncated.append(eos not in row[:n])
        texts.append(tokenizer.decode(row[:n], skip_special_tokens=True))
    return {
        "completion_ids": completion_ids,
        "logp": lps,
        "lengths": lengths,
        "truncated": truncated,
        "texts": texts,
    }
