"""Checkpoints beyond files: the providers (docker, libvirt, commands)
and the policy that says when a step escalates to them."""
