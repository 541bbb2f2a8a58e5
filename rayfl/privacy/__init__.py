"""Protections of the payloads between the two halves of an algorithm (see `hook`): client-level
DP (`dp`, DP-FedAvg with a `dp-accounting` accountant) and secure aggregation (`secagg`,
Bonawitz et al. 2017). The engine calls `PrivacyHook.protect` on the worker and
`PrivacyHook.combine` on the server; algorithms never see either."""

from rayfl.privacy.hook import PrivacyHook, check_fits, hook_for, sum_form

__all__ = ["PrivacyHook", "check_fits", "hook_for", "sum_form"]
