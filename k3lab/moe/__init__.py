"""The MoE half of K3: SiTU-GLU (situ), the sigmoid router and its balancers (router), LatentMoE (latent)."""
from k3lab.moe.latent import LatentMoE, RoutedExperts
from k3lab.moe.router import (AuxLossBalancer, Balancer, LossFreeBalancer, QuantileBalancer, RouterOutput,
                              SigmoidRouter, make_balancer)
from k3lab.moe.situ import SiTUMLP, glu_activation, situ_glu, swiglu

__all__ = ["LatentMoE", "RoutedExperts", "AuxLossBalancer", "Balancer", "LossFreeBalancer", "QuantileBalancer",
           "RouterOutput", "SigmoidRouter", "make_balancer", "SiTUMLP", "glu_activation", "situ_glu", "swiglu"]
