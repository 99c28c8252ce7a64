"""RL refinement of a supervised TraceLock controller (paper appendix "Beyond Supervised Trace Learning"): Bernoulli
commit decisions, group-relative advantages, a policy-gradient loss with an entropy bonus, pluggable rewards."""
