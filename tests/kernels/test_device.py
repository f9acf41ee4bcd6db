"""The device facts the kernels read (nanovllm.kernels.device)."""

import pytest
import torch

from nanovllm.kernels.device import capability, num_sms


def test_cpu_has_a_small_sm_count_and_no_capability() -> None:
    assert num_sms(torch.device("cpu")) == 8
    with pytest.raises(ValueError, match="not a CUDA device"):
        capability(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_facts_are_the_device_properties() -> None:
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    for device in (torch.device("cuda"), torch.device("cuda", index)):
        assert num_sms(device) == props.multi_processor_count
        assert capability(device) == (props.major, props.minor)
