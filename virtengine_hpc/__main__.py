from virtengine_hpc.cli import entry

entry()
