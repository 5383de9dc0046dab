"""Tiled PyTorch reference backend: any device, fp32 accumulation, memory O(tile) (docs/design.md)."""
