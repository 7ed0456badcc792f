"""Mixed precision: loss scaling, fp32 master weights, global gradient norm."""
