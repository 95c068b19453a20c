"""`headrace bench`: open-loop load against headrace and the baselines a user would compare."""
