"""Draft heads that read the target's own hidden states (EAGLE-3's shape): the head, the layouts
published heads come in, the tap that collects the target's features, and the drafter."""
