"""The example corpus (data only), shipped so the demo and tests run anywhere."""
