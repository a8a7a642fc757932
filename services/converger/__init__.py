"""converger: turns the devices section of the NodeSpec into holds (CDI spec, env file, slice).

Plans and applies the seed's pass (observe -> pure plan -> idempotent apply),
tracks Kubernetes releases and asks for VFIO switches. Unprivileged; never
holds a key or talks upstream. Built in the converger issue.
"""
