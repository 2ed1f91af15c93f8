"""What a training run is configured with: project and data-loader options, kwargs handlers, the
parallelism layout, constants."""
