"""inventory service: discovers GPUs, MIG instances, slots and host resources through a vendor adapter and publishes the Inventory"""
