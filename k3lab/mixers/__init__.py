"""Token mixers: the linear-attention lineage (recurrent and chunked), KDA and Gated MLA layers."""
