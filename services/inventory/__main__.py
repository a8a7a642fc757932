from services.inventory.service import main

main()
