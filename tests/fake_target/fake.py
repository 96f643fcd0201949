"""A target written as a new file of quantprep/targets/ would be (tests/test_fake_target.py puts this
directory on that package's path and the name in TARGET_NAMES): a "fake" accelerator whose modules
are the cpu target's, so off its device they run on the CPU as its emulator, with device facts of
its own that nothing outside targets/ knows."""

from quantprep.targets.cpu import CpuTarget


class FakeTarget(CpuTarget):
    name = "fake"
    device = "fake"
    cpu_emulator = True
    preference = 0  # before the CPU, as an accelerator
    jit_kernels = True
    synchronized = 0

    def runtime_problem(self) -> str | None:
        return None if self.present() else "no fake device here"

    def present(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.synchronized += 1

    def cache_key_fields(self, started: bool = True) -> dict:
        return {"fake_arch": "f1"} | ({"fake_driver": "9.9"} if started else {})

    def plan_key_fields(self) -> dict:
        return {"fake_units": 4}

    def describe(self) -> dict:
        return {"name": "Fake One", "notes": ["a fake device"]}

    def variant_name(self, manifest: dict) -> str:
        return f"{self.name}-f1"


TARGET = FakeTarget()
