"""The state a checkpoint is loaded into (`spotguard/checkpoint/state.py`): an optimizer that took no step gets its
state zeroed without the arithmetic of DCP's step of zeros, and exactly as that step leaves it."""

from __future__ import annotations

import pytest
import torch

from spotguard.checkpoint.state import to_dcp


class Seen(torch.optim.SGD):
    """SGD that records the devices its steps saw the parameters on; with `reads`, a step that reads a value."""

    def __init__(self, params, reads: bool = False, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.devices: list[str] = []
        self.reads = reads

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.devices.append(p.device.type)
                if self.reads:
                    float(p.grad.sum())  # no value on meta
        return super().step(closure)


def fresh(kind: str, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = Seen(model.parameters(), lr=0.1, momentum=0.9, **kwargs) if kind == "Seen" else (
        getattr(torch.optim, kind)(model.parameters(), lr=0.1))  # fmt: skip
    return model, optimizer


def flat(state: dict) -> dict:
    return {f"{k}.{name}": v for k, entries in state["state"].items() for name, v in entries.items()}


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "RMSprop", "Seen"])
def test_an_optimizer_without_state_gets_it_zeroed_as_dcp_does_without_its_arithmetic(kind):
    model, optimizer = fresh(kind)
    weights = [p.detach().clone() for p in model.parameters()]
    pointers = [p.data_ptr() for p in model.parameters()]
    made = flat(to_dcp({"m": model, "o": optimizer}, to_load=True)["o"])
    reference_model, reference = fresh(kind)
    expected = flat(to_dcp({"m": reference_model, "o": reference})["o"])  # DCP's own step of zeros
    assert made.keys() == expected.keys() and made
    assert all(torch.equal(made[k], expected[k]) and made[k].device == expected[k].device for k in made)
    assert [p.data_ptr() for p in model.parameters()] == pointers and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    if kind == "Seen":
        assert set(optimizer.devices) == {"meta"} and set(reference.devices) == {"cpu"}


def test_an_optimizer_that_reads_values_in_its_step_gets_dcps_step():
    model, optimizer = fresh("Seen", reads=True)
    made = flat(to_dcp({"m": model, "o": optimizer}, to_load=True)["o"])
    assert "cpu" in optimizer.devices and all(not v.is_meta for v in made.values())
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in made.items() if k.endswith("momentum_buffer"))


def test_a_frozen_parameter_and_one_listed_twice_are_as_after_dcps_step():
    """A frozen parameter gets no state; a parameter listed twice gets one, and no stand-in is left behind."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[1].bias.requires_grad_(False)
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch allows it, with a warning
        optimizer = Seen([*model.parameters(), model[0].weight], lr=0.1, momentum=0.9)
    to_dcp({"m": model, "o": optimizer}, to_load=True)
    assert set(optimizer.devices) == {"meta"}  # no second step, on the parameters themselves
    assert set(optimizer.state) == {model[0].weight, model[0].bias, model[1].weight}
    assert all(torch.equal(e["momentum_buffer"], torch.zeros_like(p)) for p, e in optimizer.state.items())
