"""The distributed trainer: parallel dims, FSDP2, expert parallel (MoonEP), context parallel (KCP), DCP, torchrun."""
