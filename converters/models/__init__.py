"""What the converters know about models, in one place. ``facts``: everything transformers knows (the
class a config builds, tied weights, on-disk vs module names), asked, never tabled; ``config_arg``: the
``--config`` a bare checkpoint needs, checked against its tensors; ``megatron_family`` and one module per
family: the Megatron name maps, the one thing no installed library knows."""
