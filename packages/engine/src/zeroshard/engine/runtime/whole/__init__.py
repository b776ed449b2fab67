"""Whole-matrix optimizers (torch.optim.Muon, or any that declares it needs a parameter's
full shape): which rank owns each matrix, how its pieces reach the owner and come back,
and the steppers. Part of the runtime, behind the `Stepper` seam."""
