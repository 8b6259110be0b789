"""Training: batches, fused embedding kernels, the DLRM model, the train loop, metrics."""
