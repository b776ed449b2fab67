"""Lightning's fit on zeroshard stage 3 against the plain zs3 step: `-m benchmarks.lightning`."""
