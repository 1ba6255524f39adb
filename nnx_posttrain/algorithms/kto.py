"""KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"), as
TRL 1.16's KTOTrainer: unpaired desirable / undesirable examples, a KL reference point from
mismatched completions (``losses.preference.kto``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from nnx_posttrain import config as config_lib, data, errors, model
from nnx_posttrain.algorithms.base import AlgorithmBase
from nnx_posttrain.algorithms.pairs import sequence_logps
from nnx_posttrain.algorithms.reference import Reference
from nnx_posttrain.losses.kto import KTOExamples, KTOOptions, kto
from nnx_posttrain.losses.router import RouterOptions, with_router_aux


@dataclasses.dataclass(frozen=True)
class KTOConfig(KTOOptions, RouterOptions):
    """Kahneman-Tversky Optimization on unpaired desirable / undesirable examples.

    A mixture-of-experts policy adds its router load-balancing loss over the examples' rows (not
    the KL rows', nor the reference's), as TRL's KTOTrainer."""

    reference: Reference = "auto"

    def problems(self) -> list[str]:
        return KTOOptions.problems(self) + RouterOptions.problems(self)


@dataclasses.dataclass
class KTORunConfig(config_lib.Config):
    """A KTO run's settings: the common ones, KTO's own under ``algo``."""

    algo: KTOConfig = dataclasses.field(default_factory=KTOConfig)


class KTO(AlgorithmBase):
    """KTO's KL reference point uses mismatched completions: each prompt of the batch with the
    next example's completion (as TRL), built on the host by ``prepare``. Those pairs depend on
    the shuffled batch, so their reference log-probs cannot be precomputed (apo_zero_unpaired
    has no KL rows: it can)."""

    name = "kto"
    Config = KTOConfig
    RunConfig = KTORunConfig
    data_kind = "unpaired_preference"
    sequences_per_example = 2  # the example and its KL row
    defaults = dict(optim=dict(learning_rate=1e-6))  # TRL's KTOTrainer

    def setup(self, module):
        super().setup(module)
        if self.reference_mode == "precompute" and self.calculate_kl:
            raise errors.ConfigError(
                "kto: --algo.reference precompute is not supported (the KL pairs are formed "
                "within each shuffled batch); use lora_base or copy, or --algo.loss-type "
                "apo_zero_unpaired (no KL pairs)")

    def read_data(self, run_cfg, train_src, eval_src, echo):
        """Preference pairs read as TRL's KTOTrainer reads them: each pair a desirable
        (chosen) and an undesirable (rejected) example."""
        fmt = run_cfg.batching.format
        if data.data_format(train_src, fmt) != "preference":
            return train_src, eval_src
        echo(f"{run_cfg.data}: preference pairs read as unpaired examples, as TRL's KTO reads "
             "them: each pair's chosen completion desirable, its rejected one undesirable")
        return tuple(data.unpaired(src) if src is not None and data.data_format(src, fmt) ==
                     "preference" else src for src in (train_src, eval_src))

    def describe_data(self, report):
        return f", {report.desirable} desirable / {report.undesirable} undesirable"

    def check_train_data(self, report, echo):
        """The desirable / undesirable balance, with TRL's advice (KTOTrainer): a class missing,
        or weights outside the range where desirable_weight x desirable / (undesirable_weight x
        undesirable) is in [1, 4/3], is warned about (training goes on)."""
        d, u = report.desirable, report.undesirable
        wd, wu = self.cfg.desirable_weight, self.cfg.undesirable_weight
        if not (d and u):
            missing = "undesirable" if d else "desirable"
            echo(f"warning: the train data has no {missing} example ({d} desirable / {u} "
                 f"undesirable labels): KTO learns from the contrast of both kinds; the {missing} "
                 "loss term and its metrics are empty")
            return
        if d == u:
            return
        desirable = (round(u * wu / d, 2), round(u * wu / d * 1.33, 2))
        undesirable = (round(d * wd / u / 1.33, 2), round(d * wd / u, 2))
        if not (desirable[0] <= wd <= desirable[1] or undesirable[0] <= wu <= undesirable[1]):
            echo(f"warning: {d} desirable and {u} undesirable examples, weighted {wd:g} / {wu:g}: "
                 f"as TRL advises, set EITHER --algo.desirable-weight in [{desirable[0]:g}, "
                 f"{desirable[1]:g}] OR --algo.undesirable-weight in [{undesirable[0]:g}, "
                 f"{undesirable[1]:g}] (not both)")

    @property
    def calculate_kl(self) -> bool:
        """TRL's ``calculate_KL``: apo_zero_unpaired needs no KL rows (z0 = 0)."""
        return self.cfg.calculate_kl

    def prepare(self, batch):
        if not self.calculate_kl:
            return super().prepare(batch)
        ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        n, width = ids.shape
        kl_ids = np.zeros_like(ids)
        kl_att = np.zeros_like(att)
        kl_mask = np.zeros_like(mask)
        for i in range(n):
            j = (i + 1) % n
            # the prompt is what precedes the completion: not the template's tokens after it
            loss_i = np.flatnonzero(mask[i] > 0)
            start = int(loss_i[0]) if len(loss_i) else width
            prompt = ids[i][:start][att[i][:start] > 0]
            completion = ids[j][(att[j] > 0) & (mask[j] > 0)]
            row = np.concatenate([prompt, completion])[:width]
            kl_ids[i, : len(row)] = row
            kl_att[i, : len(row)] = 1
            kl_mask[i, len(prompt) : len(row)] = 1
        return super().prepare(dict(batch, kl_input_ids=kl_ids, kl_attention_mask=kl_att,
                                    kl_loss_mask=kl_mask))

    def _forward(self, m, batch):
        if not self.calculate_kl:
            summed, _, _ = sequence_logps(m, batch["input_ids"], batch["attention_mask"],
                                          batch["loss_mask"], self.logprob_chunk,
                                          batch.get("positions"))
            return summed, None
        cat = lambda k: jnp.concatenate([batch[k], batch[f"kl_{k}"]], axis=0)
        summed, _, _ = sequence_logps(m, cat("input_ids"), cat("attention_mask"),
                                      cat("loss_mask"), self.logprob_chunk,
                                      cat("positions") if "positions" in batch else None)
        n = batch["input_ids"].shape[0]
        return summed[:n], summed[n:]

    def _policy(self, module, batch):
        """The policy's ``_forward`` and its router logits (``losses.router``), those of the
        examples' rows only: TRL takes the aux loss from the examples' forward, the KL rows'
        runs without gradient (their rows follow the examples' in the one concatenated pass)."""
        with model.routers_captured(module, self.cfg.router_aux_loss_coef) as routers:
            policy, kl_policy = self._forward(module, batch)
        routed = routers.routed()
        if routed is not None and kl_policy is not None:
            examples = batch["input_ids"].size  # rows batch-major: the examples' come first
            routed = routed._replace(mask=routed.mask.at[examples:].set(0.0))
        return (policy, kl_policy), routed

    def loss(self, module, batch, reference=None):
        (policy, kl_policy), routed = self._policy(module, batch)
        if self.reference_mode == "precompute":
            ref, kl_ref = batch["ref_logps"], batch.get("ref_kl_logps")
        else:
            ref, kl_ref = self.reference(module, reference, lambda m: self._forward(m, batch))
        return with_router_aux(kto(KTOExamples(policy, ref, batch["label"], kl_policy, kl_ref),
                                   self.cfg), routed)

    def reference_logps(self, module, batch):
        ref, kl_ref = self._forward(module, batch)
        return {"ref_logps": ref} if kl_ref is None else {"ref_logps": ref, "ref_kl_logps": kl_ref}
