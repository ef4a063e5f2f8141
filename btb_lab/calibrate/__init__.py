"""Calibration: measure a real engine (`measure`), fit its cost profile (`fit`), and the
`btb-lab calibrate` entry point (`run`). The profile it writes is read by
`btb_lab.model.profile` when a hypothesis sets `costs.model: {profile: PATH}`."""
