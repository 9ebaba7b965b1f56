"""Lightning glue: the OPD LightningModule, its callbacks, metrics and prompt data."""
