"""The CPU's identity names its core by vendor, family and model (a VM's model name is often just
"AMD EPYC", and figures must say which machine measured them)."""

from strata.cpuinfo import cpu_identity, microarchitecture


def test_the_dev_machines_cores_are_named():
    assert microarchitecture("AuthenticAMD", 25, 1) == "Zen 3 (Milan)"
    assert microarchitecture("AuthenticAMD", 25, 17) == "Zen 4 (Genoa)"
    assert microarchitecture("AuthenticAMD", 26, 2) == "Zen 5 (Turin)"
    assert microarchitecture("GenuineIntel", 6, 207) == "Emerald Rapids"
    assert microarchitecture("GenuineIntel", 6, 143) == "Sapphire Rapids"


def test_an_unknown_core_has_no_name_but_keeps_its_numbers():
    assert microarchitecture("GenuineIntel", 6, 1) == ""
    assert microarchitecture("SomeVendor", 25, 17) == ""
    ident = cpu_identity()
    assert set(ident) == {"vendor", "family", "model", "microarchitecture", "label"}
    if ident["family"] >= 0 and ident["model"] >= 0:
        assert ident["label"].startswith(f"family {ident['family']} model {ident['model']}")
