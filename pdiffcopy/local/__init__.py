"""This machine: platform calls, confinement, fd helpers, fastcopy, LocalFile, LocalTree, copyfile."""
