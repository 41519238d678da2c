"""Which optimizer a torch optimizer state dict is from, told by the keys its param groups hold as each optimizer
puts them there (torch's and transformers' own optimizers, built here), and which of its state is the parameter's
shape, told by a step with the checkpoint's hyperparameters."""

from __future__ import annotations

import pytest
import torch
import transformers

from converters.optimizer_class import DEFAULT, claimed, class_of, known, moments, state_shapes


def _groups(opt: torch.optim.Optimizer) -> list[dict]:
    return opt.state_dict()["param_groups"]


@pytest.mark.parametrize("name", sorted(known("transformers.")))
def test_every_optimizer_torch_and_transformers_have_is_told_by_its_own_groups(name):
    cls = known(name)[name]
    param = torch.nn.Parameter(torch.ones(2, 3))
    try:
        opt = cls([param])
    except (TypeError, ValueError):
        opt = cls([param], lr=1e-3)
    groups = _groups(opt)
    assert class_of(groups) == name
    # a scheduler's initial_lr, a user's group name: keys beyond the optimizer's do not count against it
    assert class_of([{**g, "initial_lr": 1e-3, "name": "decay"} for g in groups]) == name


def test_transformers_trainers_adafactor_is_transformers_own():
    opt = transformers.optimization.Adafactor([torch.nn.Parameter(torch.ones(2, 3))], scale_parameter=False, relative_step=False, lr=1e-3)
    assert class_of(_groups(opt)) == "transformers.Adafactor"
    assert moments("transformers.Adafactor", _groups(opt)) == frozenset()  # its variances are factored


def test_adam_is_adamw_only_with_decoupled_weight_decay():
    param = torch.nn.Parameter(torch.ones(2, 3))
    assert class_of(_groups(torch.optim.Adam([param]))) == "Adam"
    assert class_of(_groups(torch.optim.Adam([param], decoupled_weight_decay=True))) == "AdamW"  # AdamW's own update


def test_groups_no_optimizer_puts_there_are_the_default():
    """DeepSpeed's FusedAdam (its defaults: no maximize, foreach or amsgrad), an older torch's Adam (no
    decoupled_weight_decay: Adam and AdamW alike), or groups holding nothing: the engines' default, AdamW."""
    fused_adam = {"params": [0], "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert class_of([fused_adam]) == DEFAULT
    older = {k: v for k, v in _groups(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))[0].items() if k != "decoupled_weight_decay"}
    assert class_of([older]) == DEFAULT
    assert class_of([{"params": [0]}]) == DEFAULT == "AdamW"


def test_moments_are_what_a_step_with_the_checkpoints_hyperparameters_keeps():
    assert moments("SGD", [{"momentum": 0.9}]) == {"momentum_buffer"}
    assert moments("SGD", [{"momentum": 0.0}]) == frozenset()
    assert moments("AdamW", [{"amsgrad": True}]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert moments("AdamW") == {"exp_avg", "exp_avg_sq"}
    # a name no known class has (a manifest's word, never imported) is judged as the default's
    assert moments("os.system", [{"amsgrad": True}]) == moments("AdamW", [{"amsgrad": True}])
    # a checkpoint's placement flags (a CUDA run's fused, capturable) do not stop the step here
    assert moments("AdamW", [{"fused": True, "capturable": True, "foreach": True}]) == {"exp_avg", "exp_avg_sq"}


def test_state_shapes_are_what_a_step_keeps_for_a_parameter_of_that_shape():
    """Traced from a step on a parameter of prime-sized dimensions: transformers' Adafactor factors a matrix's
    variance into its rows and columns and keeps a vector's whole, a stack of experts' over its last two (its step is
    a Python number, no tensor)."""
    adafactor = {"lr": 1e-3, "relative_step": False, "scale_parameter": False}
    assert state_shapes("transformers.Adafactor", adafactor, (131, 36)) == {"exp_avg_sq_row": (131,), "exp_avg_sq_col": (36,), "RMS": ()}
    assert state_shapes("transformers.Adafactor", adafactor, (36,))["exp_avg_sq"] == (36,)
    assert state_shapes("transformers.Adafactor", adafactor, (4, 131, 36))["exp_avg_sq_row"] == (4, 131)
    assert state_shapes("AdamW", {}, (4, 131, 36)) == {"step": (), "exp_avg": (4, 131, 36), "exp_avg_sq": (4, 131, 36)}


@pytest.mark.parametrize("hyper", [{"betas": (0.9, 0.999, 0.0)}, {"lr": 10 ** 400}, {"betas": [[0.9], [0.999]]}])
def test_hyperparameters_a_step_refuses_are_asked_with_the_classs_defaults(hyper):
    """A damaged or hostile group's values (three betas, a learning rate past any float, nested lists) would make
    the probe step fail: the class's own defaults answer, so the state is still held to its shapes."""
    assert state_shapes("AdamW", hyper, (5, 7)) == state_shapes("AdamW", {}, (5, 7)) == {"step": (), "exp_avg": (5, 7), "exp_avg_sq": (5, 7)}


def test_a_manifests_class_is_held_to_its_param_groups():
    """A manifest's word for the class is the checkpoint's: where its groups are another optimizer's, theirs wins
    (an AdamW state called Adafactor would escape every moment check); a name no known class has is not kept."""
    adamw = _groups(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    fused_adam = [{"params": [0], "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]
    assert claimed("transformers.Adafactor", adamw) == "AdamW"
    assert claimed("os.system", adamw) == "AdamW" and claimed("os.system", fused_adam) == DEFAULT
    assert claimed("SGD", fused_adam) == "SGD"  # groups that tell nothing: the manifest's known name stands
    assert claimed("AdamW", adamw) == "AdamW"
