"""Tolerance helpers shared by tests and notebooks: one definition of "relative error"."""

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (got - ref).norm().item()
    return diff if denom == 0.0 else diff / denom


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """Fail with a readable message when rel_err(got, ref) > tol."""
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values")
    err = rel_err(got, ref)
    if err > tol:
        raise AssertionError(f"{name}: relative error {err:.3e} > tolerance {tol:.1e}")
