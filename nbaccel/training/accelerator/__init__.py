"""The Accelerator (``core``) and the parts it holds: process control, preparation checks,
attributes."""
