"""The sharding planner: enumerate each table's sharding options, estimate their per-rank
cost and memory, assign them to ranks so that the slowest rank is as fast as possible."""
