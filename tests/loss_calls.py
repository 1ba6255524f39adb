"""The losses called with the names of their arrays and options as keywords, as the loss tests
spell them: each builds the loss's arrays (a ``NamedTuple``) and its options (a frozen dataclass,
checked when made) and calls ``loss(arrays, options)``."""

from nnx_posttrain.losses import kto as kto_lib
from nnx_posttrain.losses import preference as pl
from nnx_posttrain.losses import reward as reward_lib
from nnx_posttrain.losses import rl
from nnx_posttrain.losses.common import Pairs
from nnx_posttrain.losses.dpo import DPOOptions, DPOPairs
from nnx_posttrain.losses.dpo import dpo as dpo_loss


def dpo(pc, pr, rc, rr, *, chosen_nll=None, chosen_lengths=None, rejected_lengths=None,
        pair_weights=None, bco_delta=0.0, **options):
    """``use_weighting`` follows ``pair_weights`` unless given."""
    options.setdefault("use_weighting", pair_weights is not None)
    return dpo_loss(DPOPairs(pc, pr, rc, rr, chosen_nll, chosen_lengths, rejected_lengths,
                             pair_weights, bco_delta), DPOOptions(**options))


def simpo(chosen, rejected, *, chosen_nll=None, **options):
    return pl.simpo(Pairs(chosen, rejected, chosen_nll), pl.SimPOOptions(**options))


def cpo(chosen, rejected, *, chosen_nll=None, **options):
    return pl.cpo(Pairs(chosen, rejected, chosen_nll), pl.CPOOptions(**options))


def orpo(chosen, rejected, chosen_nll, **options):
    return pl.orpo(Pairs(chosen, rejected, chosen_nll), pl.ORPOOptions(**options))


def kto(policy, ref, labels, kl_policy, kl_ref, *, kl=None, **options):
    return kto_lib.kto(kto_lib.KTOExamples(policy, ref, labels, kl_policy, kl_ref, kl),
                       kto_lib.KTOOptions(**options))


def reward_bt(chosen, rejected, *, margin=None, **options):
    return reward_lib.reward_bt(reward_lib.RewardPairs(chosen, rejected, margin),
                                reward_lib.RewardOptions(**options))


def grpo_loss(logps, old_logps, advantages, mask, *, ref_logps=None, entropies=None, **options):
    return rl.clipped_policy_loss(rl.PolicyInputs(logps, old_logps, advantages, mask, ref_logps,
                                                  entropies), rl.GRPOOptions(**options))


def rloo_loss(logps, old_logps, advantages, mask, *, entropies=None, **options):
    return rl.rloo_loss(rl.PolicyInputs(logps, old_logps, advantages, mask, None, entropies),
                        rl.RLOOOptions(**options))
