"""ATen handlers for order-dependent ops: scans (cumsum, cumprod), arg-reductions (argmax,
argmin) and sorting (sort, topk)."""
