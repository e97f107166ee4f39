"""HARTS kernels: operators with a pure-PyTorch reference beside each fast path."""
